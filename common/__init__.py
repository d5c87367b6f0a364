"""What both process roles import: the supervisor (`supervisor/`) and its workers (`worker/`).

The kubelet's device-plugin API (`kubeletapi`) and its DRA-side APIs (`draapi`), the device and
plan model (`model`), the ZeroMQ messages (`messages`, decoded with the field readers of
`messagefields`; an MPS claim's daemon's kinds in `mpsmessages`, MIG devices made on demand in `migmessages`), socket names (`socketnames`), exit codes
(`exitcodes`), the one `Backoff` (`backoff`), the one atomic file write (`atomicfile`), the DRA
worker's checkpoint of prepared claims (`dracheckpoint`: the worker keeps it, the supervisor
reads which devices it holds), process
helpers (`procutil`), the main loops' mailbox (`mailbox`), the cache of the code `@dataclass` compiles at each start (`methodcache`:
both roles' starts read it), logging (`logs`), a worker's command line (`workerargs`: the spawner
parses it for the zygote, a worker for itself), device nodes (`devnodes`), IMEX channels (`imex`), the driver's files a container needs
(`driverfiles`), the CDI spec rules (`cdispec`: the supervisor's node-wide spec and the DRA
worker's per-claim ones are checked by them) and UUIDs as text (`uuidtext`).
Every module here is imported by both roles (tests/unit/test_structure.py checks it); what only
one role needs lives with that role. Imports nothing of `supervisor/` or `worker/`.
"""
