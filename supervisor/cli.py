"""The `gpuvisor` command: `run` (the supervisor), `labels` (node labels), `demo`, `status`, `sim`.

Errors a user can cause (a bad flag or config, no supervisor to talk to) end with one clear
line on stderr and a non-zero exit status, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from supervisor.launch import command_of

if TYPE_CHECKING:
    from supervisor.launch import Launch

DEFAULT_RUN_DIR = "/run/gpuvisor"


class _VersionAction(argparse.Action):
    """argparse's "version" action, reading the installed version only when it is asked for (the
    metadata read costs every other command ~20 ms of imports)."""

    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: Any) -> None:
        kwargs.update(nargs=0, default=argparse.SUPPRESS, help="show program's version number and exit")
        super().__init__(option_strings, dest, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, *args: Any) -> None:
        from supervisor.config.flags import installed_version

        print(f"gpuvisor {installed_version()}")
        parser.exit()


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The `gpuvisor` parser; with `command`, only that subcommand's arguments are declared (the
    others keep their name and help), so `gpuvisor run` never loads the labeller's settings."""
    from supervisor.config import RunArgumentParser, add_run_arguments

    parser = argparse.ArgumentParser(
        prog="gpuvisor",
        description="A Kubernetes device plugin for NVIDIA GPUs: one supervisor, one worker per resource.",
    )
    # NVIDIA's binaries answer --version and -v; `gpuvisor run --version` and `gpuvisor labels
    # --version` (NVIDIA's flag syntax, supervisor/config/flags.py) print the same version.
    parser.add_argument("--version", "-v", action=_VersionAction)
    # RunArgumentParser behaves as argparse's own until add_run_arguments / add_label_arguments make
    # `run` and `labels` read NVIDIA's Go flag syntax (a boolean flag takes no separate value, a
    # positional argument ends the flags), as NVIDIA's plugin and GFD read it.
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=RunArgumentParser)
    run = sub.add_parser("run", help="run the device plugin (the supervisor)")
    if command in (None, "run"):
        add_run_arguments(run)

    labels = sub.add_parser(
        "labels",
        help="label the node as GPU Feature Discovery does (NFD features.d file or NodeFeature object)",
        description="GPU Feature Discovery's node labels, with its flags and env vars (see the README, Node labels).",
    )
    if command in (None, "labels"):
        from supervisor.labels.settings import add_label_arguments

        add_label_arguments(labels)

    demo = sub.add_parser(
        "demo", help="a simulated node, a kubelet stand-in and an allocation, in a temp dir"
    )
    demo.add_argument("--profile", default="dgx-h100", help="simulator profile or node-description YAML")
    demo.add_argument("--follow", action="store_true", help="keep running until Ctrl-C")

    status = sub.add_parser("status", help="show workers, device health and allocations")
    status.add_argument("--run-dir", default=os.environ.get("GPUVISOR_RUN_DIR", DEFAULT_RUN_DIR))
    status.add_argument("--json", action="store_true", help="stable JSON instead of a table")
    status.add_argument(
        "--kubelet-dir",
        default="",
        help="where to find the kubelet's checkpoint file (default: the supervisor's plugin dir)",
    )
    status.add_argument(
        "--pod-resources-socket",
        default=os.environ.get(
            "GPUVISOR_POD_RESOURCES_SOCKET", "/var/lib/kubelet/pod-resources/kubelet.sock"
        ),
        help="the kubelet's pod-resources API socket, asked first for allocations; empty skips it "
        "(env GPUVISOR_POD_RESOURCES_SOCKET)",
    )

    sim = sub.add_parser("sim", help="inject faults into a simulated node (simulated supervisors only)")
    sim_sub = sim.add_subparsers(dest="action", metavar="ACTION", required=True)

    def common_args(p: argparse.ArgumentParser, device: bool = True) -> None:
        if device:
            p.add_argument("--device", required=True, help="GPU or MIG UUID")
        p.add_argument("--run-dir", default=os.environ.get("GPUVISOR_RUN_DIR", DEFAULT_RUN_DIR))

    xid = sim_sub.add_parser("xid", help="an XID critical error event")
    common_args(xid)
    xid.add_argument("--xid", type=int, required=True)
    xid.add_argument("--gpu-instance", type=int, default=None)
    xid.add_argument("--compute-instance", type=int, default=None)
    ecc = sim_sub.add_parser("ecc", help="an ECC error event")
    common_args(ecc)
    ecc.add_argument("--kind", choices=("single", "double"), default="double")
    for action, text in (
        ("lose", "the GPU falls off the bus"),
        ("restore", "a lost GPU comes back"),
        ("reset", "a GPU reset"),
    ):
        common_args(sim_sub.add_parser(action, help=text))
    made = sim_sub.add_parser(
        "create-instance",
        help="a MIG device made by hand: a GPU instance at a placement and its compute instance",
    )
    common_args(made)
    made.add_argument(
        "--gi-profile", type=int, required=True, help="GPU instance profile id, e.g. 9 (3g.40gb)"
    )
    made.add_argument("--placement", type=int, required=True, help="its first memory slice, e.g. 4")
    common_args(sim_sub.add_parser("instances", help="list a GPU's GPU and compute instances"))
    mig = sim_sub.add_parser("mig", help="change a GPU's MIG layout (then the supervisor rediscovers)")
    common_args(mig, device=False)
    mig.add_argument("--gpu", type=int, required=True, help="GPU index")
    mig.add_argument(
        "--layout", default="", help="comma list of profiles, e.g. 3g.40gb,2g.20gb; empty disables MIG"
    )
    return parser


COMMANDS = ("run", "labels", "demo", "status", "sim")


def dispatch(words: list[str], launch: Launch) -> int:
    """The `gpuvisor` command `words`, parsed and run, inside its launch (supervisor/__main__.py)."""
    command = command_of(words)
    parser = build_parser(command if command in COMMANDS else None)
    args = parser.parse_args(words)
    if args.command is None:
        parser.print_help()
        return 2
    try:
        if args.command == "run":
            return cmd_run(args, launch)
        if args.command == "labels":
            from supervisor.labels.daemon import main as labels_main

            return labels_main(args, os.environ)
        if args.command == "demo":
            from supervisor.sim.demo import run_demo

            return run_demo(args.profile, args.follow)
        if args.command == "status":
            return cmd_status(args)
        if args.command == "sim":
            return cmd_sim(args)
    except KeyboardInterrupt:
        return 130
    parser.error(f"unknown command {args.command}")
    return 2


def cmd_run(args: argparse.Namespace, launch: Launch) -> int:
    from common import logs, methodcache
    from supervisor.config import EXIT_CONFIG_ERROR, ConfigError, load_config
    from supervisor.main import StartupError, Supervisor

    try:
        config = load_config(args, os.environ)
    except ConfigError as exc:
        print(f"gpuvisor: {exc}", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    logs.setup(config.log_format, config.log_level, role="supervisor")
    for notice in config.notices:
        logging.getLogger("gpuvisor.config").warning("%s", notice)
    try:
        supervisor = Supervisor(config, argv_flags=args)
        if launch.zygote is not None:
            from supervisor.workers.zygote import Zygote

            supervisor.spawner.adopt(Zygote.taking(*launch.zygote))
        taken, compiled = launch.imports_done()
        if taken or compiled:
            logging.getLogger("gpuvisor.supervisor").debug(
                "dataclass code: %d texts from %s, %d compiled", taken, methodcache.cache_path(), compiled
            )
        return supervisor.run()
    except StartupError as exc:
        print(f"gpuvisor: {exc}", file=sys.stderr)
        return exc.code


def cmd_sim(args: argparse.Namespace) -> int:
    from supervisor.control.client import CommandError, send_command

    payload: dict[str, Any] = {"action": args.action, "device": getattr(args, "device", "")}
    if args.action == "xid":
        payload.update(xid=args.xid, gpu_instance=args.gpu_instance, compute_instance=args.compute_instance)
    elif args.action == "ecc":
        payload["kind"] = args.kind
    elif args.action == "mig":
        payload["gpu"] = args.gpu
        payload["layout"] = [p for p in args.layout.split(",") if p] or None
    elif args.action == "create-instance":
        payload.update(gi_profile=args.gi_profile, placement=args.placement)
    try:
        reply = send_command(args.run_dir, "sim", payload)
    except CommandError as exc:
        print(f"gpuvisor sim {args.action}: {exc}", file=sys.stderr)
        return 1
    if args.action in ("create-instance", "instances"):
        print(json.dumps(reply.get("instance", reply.get("instances")), indent=2, sort_keys=True))
        return 0
    print(f"injected: {args.action} {payload.get('device', '')}".rstrip())
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    from supervisor.control.client import CommandError, send_command
    from supervisor.observe.allocations import current_allocations

    try:
        # The document as JSON gave it: from here on it is only read and printed.
        data: dict[str, Any] = dict(send_command(args.run_dir, "status", {}))
    except CommandError as exc:
        print(f"gpuvisor status: {exc}", file=sys.stderr)
        return 1
    # Read here, not in the supervisor: the pod-resources call can block for seconds, and the
    # supervisor's loop must not.
    view = current_allocations(
        args.kubelet_dir or str(data.get("plugin_dir") or ""),
        set(data.get("resources", {})),
        pod_resources_socket=args.pod_resources_socket,
    )
    data["allocations"] = view.to_status()
    data["allocations_source"] = view.source
    if args.json:
        data["allocations_warnings"] = list(view.warnings)
        print(json.dumps(data, indent=2, sort_keys=True))
    else:
        for warning in view.warnings:
            print(f"gpuvisor status: {warning}", file=sys.stderr)
        print(format_status(data))
    return 0


def format_status(data: dict[str, Any]) -> str:
    import time

    lines = [f"supervisor pid {data.get('pid')}{'  (simulated node)' if data.get('simulated') else ''}"]
    detail = str(data.get("ready_detail") or "")
    lines.append(f"ready: {'yes' if data.get('ready') else 'no'}{f'  ({detail})' if detail else ''}")
    nvml = data.get("nvml") or {}
    if nvml and not nvml.get("up"):
        lines.append(
            f"NVML: down after {nvml.get('attempts', 0)} attempt(s): {nvml.get('error') or 'not started'}"
        )
    if data.get("metrics_url"):
        lines.append(f"metrics: {data['metrics_url']}/metrics")
    lines += _config_lines(data)
    cdi = data.get("cdi") or {}
    if cdi.get("source") or cdi.get("error"):
        lines.append(
            f"CDI spec in {cdi.get('spec_dir')}: "
            + (f"ERROR {cdi['error']}" if cdi.get("error") else f"written by {cdi['source']}")
        )
    lines.append("")
    rows: list[tuple[str, ...]] = [
        ("RESOURCE", "STATE", "REGISTRATION", "PID", "RESTARTS", "REGISTERED SINCE", "SOCKET")
    ]
    for w in data.get("workers", []):
        since = w.get("registered_since")
        rows.append(
            (
                w["resource"],
                w["state"],
                _registration_state(w),
                str(w.get("pid") or "-"),
                str(w.get("restarts", 0)),
                time.strftime("%H:%M:%S", time.localtime(since)) if since else "-",
                os.path.basename(w.get("socket") or "") or "-",
            )
        )
    lines += _table(rows)
    for w in data.get("workers", []):
        registration = _registration(w)
        if w["state"] != "RUNNING" and w.get("reason"):
            retry = w.get("next_retry_in")
            lines.append(
                f"  {w['resource']}: {w['state']}: {w['reason']}"
                + (f" (next try in {retry:g}s)" if retry is not None else "")
                + registration
            )
        elif registration:
            lines.append(f"  {w['resource']}: not registered{registration}")
    reconcile = data.get("reconcile") or {}
    pending = reconcile.get("pending")
    if pending:
        lines.append(
            f"reload pending since {pending.get('for_seconds')}s ({pending.get('trigger')}): {pending.get('reason')}; "
            f"next try in {pending.get('next_retry_in')}s"
        )
    if reconcile.get("refused"):
        lines.append(f"config refused, the running one keeps serving: {reconcile['refused']}")
    for resource, devices in sorted(data.get("resources", {}).items()):
        healthy = sum(1 for d in devices if d["health"] == "Healthy")
        lines += ["", f"{resource}: {healthy}/{len(devices)} healthy"]
        bad = [d for d in devices if d["health"] != "Healthy"]
        for d in bad:
            lines.append(f"  {d['id']}  Unhealthy  {d.get('reason', '')}")
    conditions = data.get("conditions") or []
    if conditions:
        lines += ["", "health conditions:"]
        for c in conditions:
            where = c["gpu"] + (f" GI {c['gpu_instance']}" if c.get("gpu_instance") is not None else "")
            where += f" CI {c['compute_instance']}" if c.get("compute_instance") is not None else ""
            lines.append(f"  {where}  {c['name']}  {c['recovery']}  {c.get('reason', '')}")
    mps = data.get("mps") or {}
    if mps:
        lines += ["", "MPS control daemons:"]
        for resource, d in sorted(mps.items()):
            pid = f" pid {d['pid']}" if d.get("pid") else ""
            lines.append(
                f"  {resource}  {d['state']}{pid}  restarts {d.get('restarts', 0)}  {d.get('reason', '')}"
            )
    allocations = data.get("allocations")
    if allocations:
        source = data.get("allocations_source")
        lines += ["", f"allocations{f' (from {source})' if source else ''}:"]
        rows = [("POD", "CONTAINER", "RESOURCE", "DEVICES")]  # a new table
        for a in allocations:
            rows.append((str(a["pod"]), str(a["container"]), str(a["resource"]), ",".join(a["devices"])))
        lines += _table(rows)
    return "\n".join(lines)


def _registration_state(worker: dict[str, Any]) -> str:
    """The table's word for where the worker's registration stands (its reason goes below)."""
    if worker.get("registered"):
        return "registered"
    report = str(worker.get("registration") or "")
    return report.split(" (", 1)[0] or "-"


def _registration(worker: dict[str, Any]) -> str:
    """`; registration <state> (<why>)` of a live worker not registered (as /readyz says it)."""
    if worker["state"] not in ("STARTING", "RUNNING") or worker.get("registered"):
        return ""
    return f"; registration {worker['registration']}" if worker.get("registration") else ""


def _config_lines(data: dict[str, Any]) -> list[str]:
    """Which config runs and why, and the cluster side's state (when it is on)."""
    lines = []
    config = data.get("config") or {}
    label = config.get("node_label")
    if config.get("awaiting_label"):
        lines.append(f"config: none chosen yet, waiting for the node label: {config['awaiting_label']}")
    elif config.get("name") or config.get("file"):
        lines.append(
            f"config: {config.get('name') or config.get('file')} (source: {config.get('source')})"
            + (
                f"; node label {label['key']}={label['value']!r}"
                if label and label.get("value") is not None
                else ""
            )
        )
    cluster = data.get("cluster") or {}
    if cluster.get("enabled"):
        state = f"started ({cluster.get('started_because')})" if cluster.get("started") else "not started yet"
        lines.append(f"cluster side for Node {cluster.get('node')}: {state}")
        if cluster.get("error"):
            lines.append(f"  cannot start: {cluster['error']}")
        watch = (cluster.get("label") or {}).get("watch") or {}
        if watch.get("error"):
            lines.append(f"  node label watch failing since {watch.get('failing_since')}: {watch['error']}")
        health = cluster.get("node_health") or {}
        condition = health.get("condition")
        if condition:
            written = "written" if health.get("written") else "not written yet"
            lines.append(
                f"  Node condition GPUUnhealthy={condition['status']} ({condition['reason']}), {written}"
            )
        if health.get("error"):
            lines.append(f"  health on the Node failing: {health['error']}")
        lines += _dra_lines(cluster.get("dra") or {})
    return lines


def _dra_lines(dra: dict[str, Any]) -> list[str]:
    """The DRA pool at the API server and the claims fetched for the DRA worker."""
    lines = []
    pool = dra.get("slices") or {}
    if pool:
        state = pool.get("state")
        if state == "published":
            lines.append(
                f"  DRA pool {pool.get('pool')}: generation {pool.get('generation')}, {pool.get('slices')} "
                f"ResourceSlice(s), {pool.get('devices')} device(s), device taints {pool.get('taints')}"
            )
        else:
            lines.append(f"  DRA pool {pool.get('pool')}: {state}")
        held = pool.get("held_by_device_plugin") or {}
        if held:
            lines.append(
                "  left out, held by device-plugin containers: "
                + ", ".join(f"{name} ({', '.join(pods)})" for name, pods in held.items())
            )
        if pool.get("error"):
            lines.append(f"  DRA slices failing since {pool.get('failing_since')}: {pool['error']}")
    claims = dra.get("claims") or {}
    if claims.get("fetched") or claims.get("failed"):
        lines.append(f"  DRA claims fetched: {claims.get('fetched')}, failed: {claims.get('failed')}")
    if claims.get("error"):
        lines.append(f"  DRA claims failing: {claims['error']}")
    return lines


def _table(rows: list[tuple[str, ...]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows]
