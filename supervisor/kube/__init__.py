"""The one way gpuvisor talks to the Kubernetes API server.

Everything that reads or writes API objects goes through this layer: the NodeFeature labels
(`gpuvisor labels`), the node's config chosen by its label and health on the Node (the
`cluster` package inside `gpuvisor run`), the DRA driver's ResourceSlices and claims (`dra`). It owns, once each:

- `credentials`  a kubeconfig or the pod's service account, with client-go's rules;
- `client`       `KubeClient`: bounded HTTPS calls over the standard library on kept-alive
                 connections (a small pool; a watch has its own), gpuvisor's user agent and field
                 manager, counted; a 429's `Retry-After` honoured; `abort()` ends every call now;
- `limiter`      client-go's token bucket (`--kube-api-qps`, `--kube-api-burst`), one per process;
- `watch`        `ListWatch` / `ObjectWatch`: list, then watch a collection by field selector
                 (or one named object), resourceVersion kept, a new list on 410 Gone, client-go's
                 watch timeout and jittered backoff, each failure logged once and counted;
- `recorder`     Events correlated as client-go's recorder does (counts, combining, spam filter);
- `failing`      `Failing`: a background caller's failures, counted, each distinct one said once,
                 the run's start kept, its end said and the backoff reset;
- `errors`       `ApiError` (with what the server said, or that it said nothing), `Stopped`,
                 `CredentialsError`.

It is imported only by a feature that needs it, and only once that feature starts (inside
`gpuvisor run`, after the first registration with the kubelet): `ssl` and `http.client` are
most of its cost (tests/unit/test_structure.py checks that nothing loads it at start).

May import: `common/` only (no other supervisor package).
"""
