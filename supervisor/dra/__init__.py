"""The supervisor's side of DRA (`--mode dra`): what the node publishes to the API server, the
DRA worker's claims, and its drain when the node turns device plugin.

- `slices`   the node's ResourceSlices as NVIDIA's DRA driver publishes them (devices, attributes,
             capacities, health taints): a pure function of the node and the health book's
             conditions, the API server's rules for them, and `PoolWant` (what the pool should show);
- `devices`  one device described (attribute values, attributes, capacities, health taints), for
             `slices` and `partitions`;
- `publish`  `SlicePublisher`: the thread that keeps them at the API server (owned by the Node,
             a new pool generation per change, republished after the kubelet wipes them, taints
             where the server keeps them), and withdraws them when the node turns device plugin;
- `memshare` full GPUs shared by memory in the slices (consumable capacity: `allowMultipleAllocations`,
             a request policy on `memory`), the API server's rules for it, and the claim status's share;
- `partitions` partitionable GPUs in the slices (MIG on demand: counter sets, the full GPU and every
             placement, the layout by Kubernetes version);
- `sliceview` what the publisher reads of slice objects, and the listing of one node's;
- `probe`    `FieldProbe`: whether the API server keeps a gated slice field (taints, sharing,
             shared counters), and the API server's version;
- `migs`     `MigRequests`: the DRA worker's MIG devices made on demand, created and destroyed on
             their thread, and what no claim holds destroyed;
- `held`     devices the device plugin's containers still hold, as DRA device names (left out);
- `claims`   `ClaimFetcher`: the DRA worker's ResourceClaims, fetched with the node's API client;
- `earlier`  `EarlierPool`: the pool an earlier DRA life published on this node, withdrawn (within a
             bound) before a start in device-plugin mode offers a GPU;
- `released` `ReleasedResources`: a device-plugin resource the kubelet left at 0 on the Node,
             removed once the kubelet let go of it (the 1.34 scheduler serves it through DRA
             only where the Node lacks it);
- `claimstatus` `ClaimStatusWriter`: each prepared claim's device health in its ResourceClaim's
             `status.devices`;
- `drain`    `DraDrain`: what planning in device-plugin mode may hand out while the DRA worker
             drains (its heartbeat's confirmation, then its checkpoint), and the wait for `earlier`;
- `background` `PassThread`: the one thread shape of `released` and `claimstatus` (a pass when
             woken or due, API failures retried with capped backoff and said once);
- `side`     `DraSide`: the one DRA part the main loop wires (it holds `earlier` and `drain`), and
             the part the cluster side starts (supervisor/cluster `ClusterPart`).

`publish` (and through it `supervisor.kube`) is imported only when the cluster side starts.
May import: `common/`, `supervisor.scheduler`, `supervisor.kube`, `supervisor.config`,
`supervisor.node`, `supervisor.health`, `supervisor.observe`, `supervisor.workers`,
`supervisor.cluster`, `supervisor.mps` (an MPS claim's daemon, `side` holds their wiring).
"""
