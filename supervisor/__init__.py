"""The supervisor process: `gpuvisor run`, and the `labels`, `status`, `sim` and `demo` commands.

`main.py` is the loop and the wiring of the parts, `cli.py` the `gpuvisor` command, `__main__.py`
its entry point and `launch.py` what it does first and undoes last (the worker zygote starts
before anything else is imported), and `scheduler.py` the one scheduler every timer runs on. Everything else is a subpackage with one
area each. A subpackage imports `common/`, `supervisor.scheduler` and the subpackages *below* it
in this list, never one above it (tests/unit/test_structure.py checks this):

    desired   discovery, reload and rediscovery -> the wanted plans; the reconciler that owns them
    dra       the DRA driver (`--mode dra`): its ResourceSlices at the API server, the worker's claims
    cluster   what the API server holds for this node: its config label, health on the Node
    labels    GPU Feature Discovery's node labels (`gpuvisor labels`, and inside `gpuvisor run`)
    cdi       the CDI spec, kept in step with the plans
    mps       the MPS control daemons, tied to device health
    workers   the lifecycle table, the spawner and zygote, what worker messages mean
    health    the health policy, the health book, the NVML monitor thread, the PUB hub
    sim       the NVML simulator, the kubelet stand-in, the demo
    control   the ROUTER endpoint, the command handlers, the CLI's client of them
    observe   metrics, the HTTP probes, readiness and the status document, the allocations view
    host      the run dir, the file watches (kubelet dir, config file), systemd notification
    node      the NVML adapter, node facts, planning (Node + Config -> resource plans)
    kube      the one way to the API server: credentials, client, limiter, watch, Events
    config    flags, env vars and the config file, each setting declared once -> Config

The worker process (`worker/`) is never imported here: what passes between the two roles is a
plan file and the ZeroMQ messages of `common.messages`.
"""
