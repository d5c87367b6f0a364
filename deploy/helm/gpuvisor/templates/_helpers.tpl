{{- /*
Shared definitions. The chart's decisions are made here once, as data (dicts turned to JSON
and back), and the object templates only lay them out:
  gpuvisor.validate       every render-time refusal, included at the top of every object template
                          so that the first problem is reported whatever order Helm renders in;
  gpuvisor.configChoice   which ConfigMap holds the configs, and which key a node without the
                          label nvidia.com/device-plugin.config runs (the labeller runs it);
  gpuvisor.features       whether MIG, MPS, CDI, volume-mounts or DRA may be in use, which decides
                          capabilities, host paths and host namespaces (least privilege otherwise);
  gpuvisor.apiAccess      what the plugin asks of the API server (the node's label, health on the
                          Node, the DRA driver's slices and claims), which decides its token and RBAC;
  gpuvisor.nodeRestriction  whose writes the admission policy holds to their own node, and whether
                          it is rendered (the API server serves it, or the value says so).
*/ -}}

{{- define "gpuvisor.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- /* The release name alone when it already contains the chart's name ("gpuvisor"). */ -}}
{{- define "gpuvisor.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := include "gpuvisor.name" . -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "gpuvisor.labellerName" -}}
{{- printf "%s-%s" (include "gpuvisor.fullname" .) (.Values.gfd.nameOverride | default "gpu-feature-discovery") | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "gpuvisor.namespace" -}}
{{- .Values.namespaceOverride | default .Release.Namespace -}}
{{- end -}}

{{- define "gpuvisor.image" -}}
{{- printf "%s:%s" .Values.image.repository (.Values.image.tag | default .Chart.AppVersion | toString) -}}
{{- end -}}

{{- /* Labels of every object. */ -}}
{{- define "gpuvisor.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
app.kubernetes.io/name: {{ include "gpuvisor.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/part-of: gpuvisor
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{- /*
Selector labels of one component (dict "root" . "component" NAME): selectorLabelsOverride replaces
name and instance, as in NVIDIA's chart; the component is always added, so the plugin's and the
labeller's DaemonSets select only their own pods (NVIDIA's two DaemonSets share one selector).
*/ -}}
{{- define "gpuvisor.selectorLabels" -}}
{{- $root := .root -}}
{{- $labels := dict -}}
{{- if $root.Values.selectorLabelsOverride -}}
{{- $labels = deepCopy $root.Values.selectorLabelsOverride -}}
{{- else -}}
{{- $_ := set $labels "app.kubernetes.io/name" (include "gpuvisor.name" $root) -}}
{{- $_ := set $labels "app.kubernetes.io/instance" $root.Release.Name -}}
{{- end -}}
{{- $_ := set $labels "app.kubernetes.io/component" .component -}}
{{- toYaml $labels -}}
{{- end -}}

{{- /* Pod labels: the selector labels plus name and instance (kept when the selector is overridden). */ -}}
{{- define "gpuvisor.podLabels" -}}
{{- $labels := include "gpuvisor.selectorLabels" . | fromYaml -}}
{{- $_ := set $labels "app.kubernetes.io/name" (include "gpuvisor.name" .root) -}}
{{- $_ := set $labels "app.kubernetes.io/instance" .root.Release.Name -}}
{{- toYaml $labels -}}
{{- end -}}

{{- define "gpuvisor.embeddedConfigMapName" -}}
{{- printf "%s-configs" (include "gpuvisor.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- /*
The configs, as JSON {"configMap": NAME or "", "key": KEY or ""}. The plugin gets the whole
ConfigMap and picks a key per node itself, with NVIDIA's config-manager rules (the node label
nvidia.com/device-plugin.config, else config.default, else the fallbacks in order:
cmd/config-manager/main.go:335-393), and so does the labeller. `key` is the choice for a node
without the label ("" for no config file), which the chart makes once, to refuse a map where none
can be made as NVIDIA's chart does (templates/validation.yml) and to grant what any config needs.
With config.name the keys are read from the live ConfigMap (`lookup`, on install and upgrade);
offline (helm template) they are unknown, and the pods choose at run time.
*/ -}}
{{- define "gpuvisor.configChoice" -}}
{{- $config := .Values.config -}}
{{- $choice := dict "configMap" "" "key" "" -}}
{{- if or $config.map $config.name -}}
  {{- $keys := list -}}
  {{- $known := false -}}
  {{- $where := "" -}}
  {{- if $config.map -}}
    {{- $_ := set $choice "configMap" (include "gpuvisor.embeddedConfigMapName" .) -}}
    {{- $keys = keys $config.map | sortAlpha -}}
    {{- $known = true -}}
    {{- $where = "config.map" -}}
  {{- else -}}
    {{- $_ := set $choice "configMap" (toString $config.name) -}}
    {{- $where = printf "the ConfigMap %s (config.name)" $config.name -}}
    {{- $live := lookup "v1" "ConfigMap" (include "gpuvisor.namespace" .) (toString $config.name) -}}
    {{- if $live -}}
      {{- $keys = keys ($live.data | default dict) | sortAlpha -}}
      {{- $known = true -}}
    {{- end -}}
  {{- end -}}
  {{- if $config.default -}}
    {{- if and $known (not (has (toString $config.default) $keys)) -}}
      {{- fail (printf "gpuvisor chart: config.default %q is not a key of %s (keys: %s)" (toString $config.default) $where (join ", " $keys)) -}}
    {{- end -}}
    {{- $_ := set $choice "key" (toString $config.default) -}}
  {{- else -}}
    {{- $found := false -}}
    {{- range $strategy := $config.fallbackStrategies -}}
      {{- if not $found -}}
        {{- if and (not $known) (has $strategy (list "named" "single")) -}}
          {{- $found = true -}}
        {{- end -}}
        {{- if eq $strategy "named" -}}
          {{- if has "default" $keys -}}
            {{- $_ := set $choice "key" "default" -}}
            {{- $found = true -}}
          {{- end -}}
        {{- else if eq $strategy "single" -}}
          {{- if eq (len $keys) 1 -}}
            {{- $_ := set $choice "key" (first $keys) -}}
            {{- $found = true -}}
          {{- end -}}
        {{- else if eq $strategy "empty" -}}
          {{- $found = true -}}
        {{- else -}}
          {{- fail (printf "gpuvisor chart: config.fallbackStrategies: unknown strategy %q (known: named, single, empty)" (toString $strategy)) -}}
        {{- end -}}
      {{- end -}}
    {{- end -}}
    {{- if not $found -}}
      {{- fail (printf "gpuvisor chart: %s holds %d configs (%s) and none is the default for a node without the label nvidia.com/device-plugin.config: set config.default to one of them, or name one `default` (fallback \"named\"), or add the fallback \"empty\"; fallbacks tried, in order: [%s] (NVIDIA's chart refuses this too)" $where (len $keys) (join ", " $keys) (join ", " ($config.fallbackStrategies | default list))) -}}
    {{- end -}}
  {{- end -}}
{{- end -}}
{{- toJson $choice -}}
{{- end -}}

{{- /*
The value at a key path in a parsed config (dict "in" CONFIG "path" KEYS), as JSON {"v": VALUE}, with
"" where the path is missing or crosses something that is not a mapping (sprig's dig would panic
there, and a malformed config is gpuvisor's to report, with its own message, at start).
*/ -}}
{{- define "gpuvisor.get" -}}
{{- $node := .in -}}
{{- range .path -}}
  {{- if kindIs "map" $node -}}{{- $node = get $node . -}}{{- else -}}{{- $node = "" -}}{{- end -}}
{{- end -}}
{{- toJson (dict "v" $node) -}}
{{- end -}}

{{- /* Whether a device-list strategy (a string, possibly a comma list, or a list) names one of `wanted`. */ -}}
{{- define "gpuvisor.strategyHasAny" -}}
{{- $found := false -}}
{{- $names := list -}}
{{- if kindIs "string" .strategy -}}
  {{- $names = splitList "," .strategy -}}
{{- else if kindIs "slice" .strategy -}}
  {{- $names = .strategy -}}
{{- end -}}
{{- range $names -}}
  {{- if has (trim (toString .)) $.wanted -}}{{- $found = true -}}{{- end -}}
{{- end -}}
{{- $found -}}
{{- end -}}

{{- /*
What the pods may need, as JSON {"mig", "mps", "cdi", "volumeMounts"}: a value set in the chart
wins over the config file (its env var wins on the node); otherwise the configs decide, every
one of config.map (a node's label may choose any of them, as NVIDIA's chart counts them all);
with config.name, whose contents are unknown at render time, everything counts, as NVIDIA's
chart assumes MIG for an external ConfigMap. gpuvisor.features.* (true/false) overrides the outcome.
*/ -}}
{{- define "gpuvisor.features" -}}
{{- $v := .Values -}}
{{- $choice := include "gpuvisor.configChoice" . | fromJson -}}
{{- $external := and (not $v.config.map) (not (empty $v.config.name)) -}}
{{- $configs := list -}}
{{- range $key, $text := ($v.config.map | default dict) -}}
  {{- $parsed := fromYaml (toString $text) -}}
  {{- if not (hasKey $parsed "Error") -}}{{- $configs = append $configs $parsed -}}{{- end -}}
{{- end -}}
{{- $f := dict "mig" $external "mps" $external "cdi" $external "volumeMounts" $external "dra" $external -}}
{{- if eq (toString $v.gpuvisor.mode) "dra" -}}{{- $_ := set $f "dra" true -}}{{- end -}}
{{- range $configs -}}
  {{- if eq (toString (include "gpuvisor.get" (dict "in" . "path" (list "gpuvisor" "mode")) | fromJson).v) "dra" -}}{{- $_ := set $f "dra" true -}}{{- end -}}
{{- end -}}
{{- if kindIs "string" $v.migStrategy -}}
  {{- $_ := set $f "mig" (ne $v.migStrategy "none") -}}
{{- else -}}
  {{- range $configs -}}
    {{- $mig := (include "gpuvisor.get" (dict "in" . "path" (list "flags" "migStrategy")) | fromJson).v -}}
    {{- if and $mig (ne (toString $mig) "none") -}}{{- $_ := set $f "mig" true -}}{{- end -}}
  {{- end -}}
{{- end -}}
{{- range $configs -}}
  {{- if (include "gpuvisor.get" (dict "in" . "path" (list "sharing" "mps")) | fromJson).v -}}{{- $_ := set $f "mps" true -}}{{- end -}}
{{- end -}}
{{- /* MIG devices made on demand: creating and destroying instances takes what a MIG strategy does. */ -}}
{{- range $configs -}}
  {{- if eq (toString (include "gpuvisor.get" (dict "in" . "path" (list "gpuvisor" "dra" "migOnDemand")) | fromJson).v) "true" -}}{{- $_ := set $f "mig" true -}}{{- end -}}
{{- end -}}
{{- $cdi := list "cdi-annotations" "cdi-cri" -}}
{{- $mounts := list "volume-mounts" -}}
{{- if kindIs "string" $v.deviceListStrategy -}}
  {{- $_ := set $f "cdi" (eq (include "gpuvisor.strategyHasAny" (dict "strategy" $v.deviceListStrategy "wanted" $cdi)) "true") -}}
  {{- $_ := set $f "volumeMounts" (eq (include "gpuvisor.strategyHasAny" (dict "strategy" $v.deviceListStrategy "wanted" $mounts)) "true") -}}
{{- else -}}
  {{- range $configs -}}
    {{- $strategy := (include "gpuvisor.get" (dict "in" . "path" (list "flags" "plugin" "deviceListStrategy")) | fromJson).v -}}
    {{- if eq (include "gpuvisor.strategyHasAny" (dict "strategy" $strategy "wanted" $cdi)) "true" -}}{{- $_ := set $f "cdi" true -}}{{- end -}}
    {{- if eq (include "gpuvisor.strategyHasAny" (dict "strategy" $strategy "wanted" $mounts)) "true" -}}{{- $_ := set $f "volumeMounts" true -}}{{- end -}}
  {{- end -}}
{{- end -}}
{{- range $name, $forced := ($v.gpuvisor.features | default dict) -}}
  {{- if kindIs "bool" $forced -}}{{- $_ := set $f $name $forced -}}{{- end -}}
{{- end -}}
{{- /* A DRA worker answers claims with CDI device names: the spec dir must be the runtime's. */ -}}
{{- if $f.dra -}}{{- $_ := set $f "cdi" true -}}{{- end -}}
{{- toJson $f -}}
{{- end -}}

{{- /*
A container's securityContext (dict "root" . "override" VALUES-SECURITY-CONTEXT): the override
verbatim when set (NVIDIA's rule), else least privilege as the kustomize base: root (the kubelet's
directory and socket belong to root) with every capability dropped, and SYS_ADMIN added back only
when a MIG strategy may be on (the MIG capability device nodes are granted to CAP_SYS_ADMIN) or
volume-mounts may be (the NVIDIA runtime is then commonly set to ignore NVIDIA_VISIBLE_DEVICES in
unprivileged containers: NVIDIA #856), exactly when NVIDIA's chart adds it.
*/ -}}
{{- define "gpuvisor.securityContext" -}}
{{- if .override -}}
{{- toYaml .override -}}
{{- else -}}
{{- $f := include "gpuvisor.features" .root | fromJson -}}
{{- $caps := dict "drop" (list "ALL") -}}
{{- if or $f.mig $f.volumeMounts -}}{{- $_ := set $caps "add" (list "SYS_ADMIN") -}}{{- end -}}
{{- toYaml (dict "runAsUser" 0 "runAsGroup" 0 "runAsNonRoot" false "allowPrivilegeEscalation" false "readOnlyRootFilesystem" true "capabilities" $caps "seccompProfile" (dict "type" "RuntimeDefault")) -}}
{{- end -}}
{{- end -}}

{{- /*
What the plugin asks of the API server, as JSON {"nodes": bool, "health": bool, "dra": bool}: the
node's label when it has configs to choose from (NVIDIA's config-manager reads it: get/list/watch
nodes), GPU health on the Node when gpuvisor.nodeHealth is on (patch nodes/status, create/patch
events), the DRA driver's ResourceSlices (owned by the Node: get nodes) and ResourceClaims when
DRA may be in use. None: no token, no RBAC, as the plugin then never calls the API server.
*/ -}}
{{- define "gpuvisor.apiAccess" -}}
{{- $choice := include "gpuvisor.configChoice" . | fromJson -}}
{{- $f := include "gpuvisor.features" . | fromJson -}}
{{- toJson (dict "nodes" (ne $choice.configMap "") "health" (eq (toString .Values.gpuvisor.nodeHealth) "true") "dra" $f.dra) -}}
{{- end -}}

{{- /*
The node restriction (admission-policy.yaml), as JSON {"enabled": bool, "users": [USERNAME...]}: the
usernames of this release's service accounts that get a token and write to the API server (the
plugin's, the labeller's), and whether the ValidatingAdmissionPolicy that holds them to their own
node is rendered. gpuvisor.nodeRestriction.enabled null: where the API server serves
admissionregistration.k8s.io/v1 ValidatingAdmissionPolicy. With a cluster to ask (helm install or
upgrade, or --api-versions naming kinds) Helm's discovery lists every served kind as
group/version/Kind, and the policy's kind is looked for there; offline (helm template, whose
default list names group/versions only) the Kubernetes version decides: v1 is served from 1.30.
*/ -}}
{{- define "gpuvisor.nodeRestriction" -}}
{{- $users := list -}}
{{- $ns := include "gpuvisor.namespace" . -}}
{{- if .Values.devicePlugin.enabled -}}
  {{- $api := include "gpuvisor.apiAccess" . | fromJson -}}
  {{- if or $api.nodes $api.health $api.dra -}}
    {{- $users = append $users (printf "system:serviceaccount:%s:%s" $ns (include "gpuvisor.fullname" .)) -}}
  {{- end -}}
{{- end -}}
{{- if .Values.gfd.enabled -}}
  {{- $nodeFeatures := not (and (kindIs "bool" .Values.gfd.useNodeFeatureAPI) (not .Values.gfd.useNodeFeatureAPI)) -}}
  {{- $choice := include "gpuvisor.configChoice" . | fromJson -}}
  {{- if or $nodeFeatures (not (empty $choice.configMap)) -}}
    {{- $users = append $users (printf "system:serviceaccount:%s:%s" $ns (include "gpuvisor.labellerName" .)) -}}
  {{- end -}}
{{- end -}}
{{- $wanted := .Values.gpuvisor.nodeRestriction.enabled -}}
{{- $served := false -}}
{{- if .Capabilities.APIVersions.Has "apps/v1/DaemonSet" -}}
  {{- $served = .Capabilities.APIVersions.Has "admissionregistration.k8s.io/v1/ValidatingAdmissionPolicy" -}}
{{- else -}}
  {{- $served = or (.Capabilities.APIVersions.Has "admissionregistration.k8s.io/v1/ValidatingAdmissionPolicy") (semverCompare ">=1.30.0-0" .Capabilities.KubeVersion.Version) -}}
{{- end -}}
{{- $enabled := ternary $wanted $served (kindIs "bool" $wanted) -}}
{{- toJson (dict "enabled" (and $enabled (gt (len $users) 0)) "users" $users) -}}
{{- end -}}

{{- /* An env entry for a value NVIDIA's chart passes only when it has the right type. */ -}}
{{- define "gpuvisor.typedEnv" -}}
{{- $env := list -}}
{{- range .entries -}}
  {{- $value := index . 1 -}}
  {{- $kind := index . 2 -}}
  {{- if or (and (eq $kind "bool") (kindIs "bool" $value)) (and (eq $kind "string") (kindIs "string" $value) (ne $value "")) -}}
    {{- $env = append $env (dict "name" (index . 0) "value" (toString $value)) -}}
  {{- end -}}
{{- end -}}
{{- toJson $env -}}
{{- end -}}

{{- /* Every render-time refusal; renders nothing when the values are acceptable. */ -}}
{{- define "gpuvisor.validate" -}}
{{- $v := .Values -}}
{{- if $v.namespace -}}
  {{- fail (printf "gpuvisor chart: the value 'namespace' (%v) is not supported, as in NVIDIA's chart: install with --namespace (and --create-namespace) instead" $v.namespace) -}}
{{- end -}}
{{- if and (eq .Release.Namespace "default") (not $v.allowDefaultNamespace) -}}
  {{- fail "gpuvisor chart: refusing to install into the 'default' namespace (as NVIDIA's chart): use --namespace NAME (with --create-namespace), or set allowDefaultNamespace=true" -}}
{{- end -}}
{{- if and $v.config.name $v.config.map -}}
  {{- fail "gpuvisor chart: only one of config.name (an existing ConfigMap) and config.map (configs for a ConfigMap made by this chart) may be set" -}}
{{- end -}}
{{- range $name, $text := $v.config.map -}}
  {{- if or (not (regexMatch "^[-._a-zA-Z0-9]{1,253}$" $name)) (eq $name ".") (hasPrefix ".." $name) -}}
    {{- fail (printf "gpuvisor chart: config.map key %q is not a valid ConfigMap key (letters, digits, '-', '_', '.'; not '.' or '..'-prefixed; at most 253 characters)" $name) -}}
  {{- end -}}
  {{- if not (kindIs "string" $text) -}}
    {{- fail (printf "gpuvisor chart: config.map.%s must be a string holding a config file (write it as a YAML block, `%s: |-`, or use --set-file), not a %s" $name $name (kindOf $text)) -}}
  {{- end -}}
  {{- $parsed := fromYaml $text -}}
  {{- if hasKey $parsed "Error" -}}
    {{- fail (printf "gpuvisor chart: config.map.%s is not a YAML mapping: %s" $name (toString $parsed.Error)) -}}
  {{- end -}}
{{- end -}}
{{- $_ := include "gpuvisor.configChoice" . -}}
{{- if hasPrefix "nvcr.io/nvidia/" (toString $v.image.repository) -}}
  {{- fail (printf "gpuvisor chart: image.repository %q is NVIDIA's image; this chart runs `gpuvisor run`: set image.repository (and image.tag) to your gpuvisor image" $v.image.repository) -}}
{{- end -}}
{{- if not (hasPrefix "/" (toString $v.mps.root)) -}}
  {{- fail (printf "gpuvisor chart: mps.root %q must be an absolute host path" (toString $v.mps.root)) -}}
{{- end -}}
{{- if not (has (toString $v.gpuvisor.logFormat) (list "text" "json")) -}}
  {{- fail (printf "gpuvisor chart: gpuvisor.logFormat %q must be text or json" (toString $v.gpuvisor.logFormat)) -}}
{{- end -}}
{{- $port := int64 $v.gpuvisor.metrics.port -}}
{{- if or (lt $port 1) (gt $port 65535) (ne (toString $port) (toString $v.gpuvisor.metrics.port)) -}}
  {{- fail (printf "gpuvisor chart: gpuvisor.metrics.port %v must be an integer from 1 to 65535" $v.gpuvisor.metrics.port) -}}
{{- end -}}
{{- end -}}
