{{/* Names. The default release "gpudaemon" gives "gpudaemon", "gpudaemon-extender", ... */}}
{{- define "gpudaemon.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "gpudaemon.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 50 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 50 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 50 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "gpudaemon.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Labels on every object; call with (dict "ctx" $ "component" "agent"). */}}
{{- define "gpudaemon.labels" -}}
helm.sh/chart: {{ include "gpudaemon.chart" .ctx }}
{{ include "gpudaemon.selectorLabels" . }}
app.kubernetes.io/version: {{ .ctx.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .ctx.Release.Service }}
app.kubernetes.io/part-of: gpudaemon
{{- with .ctx.Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{- define "gpudaemon.selectorLabels" -}}
app.kubernetes.io/name: {{ include "gpudaemon.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{/* No gpudaemon image is published yet: without image.repository the chart refuses,
in one line that says how to make one, rather than render an image nothing can pull. */}}
{{- define "gpudaemon.image" -}}
{{- if not .Values.image.repository -}}
{{- fail (printf "image.repository is required: no gpudaemon image is published yet; build one with scripts/build-image --tag REGISTRY/gpudaemon:%s, push it to a registry your nodes pull from (docs/install.md, \"The image\"), then --set image.repository=REGISTRY/gpudaemon" .Chart.AppVersion) -}}
{{- end -}}
{{- $tag := default .Chart.AppVersion .Values.image.tag -}}
{{- if .Values.image.digest -}}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest -}}
{{- else -}}
{{- printf "%s:%s" .Values.image.repository $tag -}}
{{- end -}}
{{- end -}}

{{- define "gpudaemon.agent.serviceAccountName" -}}
{{- default (include "gpudaemon.fullname" .) .Values.agent.serviceAccount.name -}}
{{- end -}}

{{- define "gpudaemon.extender.fullname" -}}
{{- printf "%s-extender" (include "gpudaemon.fullname" .) -}}
{{- end -}}

{{- define "gpudaemon.extender.serviceAccountName" -}}
{{- default (include "gpudaemon.extender.fullname" .) .Values.extender.serviceAccount.name -}}
{{- end -}}

{{- define "gpudaemon.scheduler.fullname" -}}
{{- printf "%s-scheduler" (include "gpudaemon.fullname" .) -}}
{{- end -}}

{{/* Which gang scheduling the gpudaemon-scheduler profile runs: "workload"
(Kubernetes' own GangScheduling plug-in, the Workload API), "coscheduling"
(scheduler-plugins' Coscheduling and its image), or "" for none. `gang.mode` wins;
without it the older `gang.enabled: true` means coscheduling. */}}
{{- define "gpudaemon.scheduler.gangMode" -}}
{{- $g := .Values.scheduler.gang -}}
{{- if and $g.mode (ne $g.mode "none") -}}{{ $g.mode }}
{{- else if and (not $g.mode) $g.enabled -}}coscheduling
{{- end -}}
{{- end -}}

{{- define "gpudaemon.scheduler.serviceAccountName" -}}
{{- default (include "gpudaemon.scheduler.fullname" .) .Values.scheduler.serviceAccount.name -}}
{{- end -}}

{{/* The agent's ServiceAccount as the API server names its user. */}}
{{- define "gpudaemon.agent.username" -}}
{{- printf "system:serviceaccount:%s:%s" .Release.Namespace (include "gpudaemon.agent.serviceAccountName" .) -}}
{{- end -}}

{{- define "gpudaemon.influxdb.tokenDir" -}}/var/run/secrets/gpudaemon/influxdb{{- end -}}

{{/* The agent's config file: the user's agent.config under the keys the chart owns. */}}
{{/* What values.schema.json's cron pattern cannot say: a range that runs backwards
(`5-3`, `fri-mon`). The agent refuses it the same way (gpudaemon/schedule.py
backward_range); tests/integration/helm/test_values_refused.py feeds both the same
values. */}}
{{- define "gpudaemon.checkSchedules" -}}
{{- $names := dict "sun" 0 "mon" 1 "tue" 2 "wed" 3 "thu" 4 "fri" 5 "sat" 6 "jan" 1 "feb" 2 "mar" 3 "apr" 4 "may" 5 "jun" 6 "jul" 7 "aug" 8 "sep" 9 "oct" 10 "nov" 11 "dec" 12 -}}
{{- range $key, $expr := (.Values.agent.config.schedules | default dict) -}}
{{- range regexFindAll "[0-9a-z]+-[0-9a-z]+" (toString $expr) -1 -}}
{{- $ends := splitList "-" . -}}
{{- $lo := ternary (atoi (index $ends 0)) (int (get $names (index $ends 0) | default 0)) (regexMatch "^[0-9]+$" (index $ends 0)) -}}
{{- $hi := ternary (atoi (index $ends 1)) (int (get $names (index $ends 1) | default 0)) (regexMatch "^[0-9]+$" (index $ends 1)) -}}
{{- if gt $lo $hi -}}
{{- fail (printf "agent.config.schedules.%s: invalid cron expression %q: the range %s runs backwards" $key (toString $expr) .) -}}
{{- end -}}
{{- end -}}
{{- range regexFindAll "[0-9]+-[0-9]+/[0-9]+" (toString $expr) -1 -}}
{{- $p := regexSplit "[-/]" . -1 -}}
{{- if lt (atoi (index $p 1)) (add (atoi (index $p 0)) (atoi (index $p 2))) -}}
{{- fail (printf "agent.config.schedules.%s: invalid cron expression %q: in %s the step is larger than the range" $key (toString $expr) .) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "gpudaemon.agent.config" -}}
{{- include "gpudaemon.checkSchedules" . -}}
{{- $managed := dict
  "labels" (dict "prefix" .Values.labelPrefix "to" "apiserver" "taint_unhealthy" .Values.agent.taintUnhealthy "mig_strategy" .Values.migStrategy)
  "metrics" (dict "listen" "0.0.0.0:9445")
  "kubernetes" (dict "lease_namespace" .Release.Namespace)
  "dra" (dict "enabled" .Values.dra.enabled)
  "remediation" (include "gpudaemon.remediation" . | fromYaml)
-}}
{{- if not .Values.agent.podResources.enabled -}}
{{- $_ := set $managed.metrics "pod_resources_socket" "" -}}
{{- end -}}
{{- if .Values.influxdb.enabled -}}
{{- $_ := set $managed "influxdb" (dict
  "url" .Values.influxdb.url
  "org" .Values.influxdb.org
  "bucket" .Values.influxdb.bucket
  "token_file" (printf "%s/%s" (include "gpudaemon.influxdb.tokenDir" .) .Values.influxdb.tokenSecret.key)
  "spool_dir" "/var/lib/gpudaemon/spool"
  "spool_max_bytes" (int64 .Values.influxdb.spool.maxBytes)
) -}}
{{- end -}}
{{- toYaml (mustMergeOverwrite (deepCopy .Values.agent.config) $managed) -}}
{{- end -}}

{{/* The extender reads the same config model; it needs the prefix, the Lease namespace,
the scheduler's name, and where to listen: loopback beside kube-scheduler (sidecar) or
every address with mutual TLS (service). */}}
{{- define "gpudaemon.extender.sidecar" -}}
{{- if eq .Values.extender.mode "sidecar" -}}true{{- end -}}
{{- end -}}

{{/* The ServiceAccount the extender runs as: the scheduler's in sidecar mode (same pod). */}}
{{- define "gpudaemon.extender.identity" -}}
{{- if include "gpudaemon.extender.sidecar" . -}}
{{- include "gpudaemon.scheduler.serviceAccountName" . -}}
{{- else -}}
{{- include "gpudaemon.extender.serviceAccountName" . -}}
{{- end -}}
{{- end -}}

{{- define "gpudaemon.extender.tlsDir" -}}/var/run/secrets/gpudaemon/extender-tls{{- end -}}
{{- define "gpudaemon.scheduler.tlsDir" -}}/var/run/secrets/gpudaemon/extender-client{{- end -}}

{{- define "gpudaemon.extender.config" -}}
{{- $e := .Values.extender -}}
{{- $ext := dict
  "policy" $e.policy
  "scheduler_name" .Values.scheduler.name
  "metrics_listen" (printf "0.0.0.0:%d" (int $e.metricsPort))
-}}
{{- if include "gpudaemon.extender.sidecar" . -}}
{{- $_ := set $ext "listen" (printf "127.0.0.1:%d" (int $e.port)) -}}
{{- else -}}
{{- $dir := include "gpudaemon.extender.tlsDir" . -}}
{{- $_ := set $ext "listen" (printf "0.0.0.0:%d" (int $e.port)) -}}
{{- $_ := set $ext "tls" (dict "cert_file" (printf "%s/tls.crt" $dir) "key_file" (printf "%s/tls.key" $dir) "client_ca_file" (printf "%s/ca.crt" $dir)) -}}
{{- end -}}
{{- $managed := dict
  "labels" (dict "prefix" .Values.labelPrefix)
  "kubernetes" (dict "lease_namespace" .Release.Namespace)
  "extender" $ext
  "dra" (dict "enabled" (and (.Values.dra).enabled true))
-}}
{{- toYaml (mustMergeOverwrite (deepCopy .Values.extender.config) $managed) -}}
{{- end -}}

{{/* The extender container, the same in its own Deployment (service mode) and in the
scheduler's pod (sidecar mode). */}}
{{- define "gpudaemon.extender.container" -}}
{{- $e := .Values.extender -}}
- name: extender
  image: {{ include "gpudaemon.image" . }}
  imagePullPolicy: {{ .Values.image.pullPolicy }}
  args: ["extender", "--config", "/etc/gpudaemon-extender/config.yaml"]
  {{- with $e.env }}
  env:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  ports:
    {{- if not (include "gpudaemon.extender.sidecar" .) }}
    - name: https
      containerPort: {{ $e.port }}
      protocol: TCP
    {{- end }}
    - name: ext-metrics
      containerPort: {{ $e.metricsPort }}
      protocol: TCP
  {{- with $e.livenessProbe }}
  livenessProbe:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $e.readinessProbe }}
  readinessProbe:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $e.resources }}
  resources:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $e.securityContext }}
  securityContext:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  volumeMounts:
    - {name: extender-config, mountPath: /etc/gpudaemon-extender, readOnly: true}
    - {name: extender-tmp, mountPath: /tmp}
    {{- if not (include "gpudaemon.extender.sidecar" .) }}
    - {name: extender-tls, mountPath: {{ include "gpudaemon.extender.tlsDir" . }}, readOnly: true}
    {{- end }}
{{- end -}}

{{- define "gpudaemon.extender.volumes" -}}
- name: extender-config
  configMap:
    name: {{ include "gpudaemon.extender.fullname" . }}
- name: extender-tmp
  emptyDir: {medium: Memory, sizeLimit: 16Mi}
{{- if not (include "gpudaemon.extender.sidecar" .) }}
- name: extender-tls
  secret:
    secretName: {{ required "extender.tls.secretName is required when extender.mode is service (a Secret with tls.crt, tls.key and ca.crt; see docs/security.md)" .Values.extender.tls.secretName }}
    defaultMode: 0440
{{- end }}
{{- end -}}

{{/* Whether a CRD-backed object renders: its switch is on, and the API exists or it is forced. */}}
{{- define "gpudaemon.hasAPI" -}}
{{- if and .values.enabled (or .values.force (.ctx.Capabilities.APIVersions.Has .api)) -}}true{{- end -}}
{{- end -}}

{{- define "gpudaemon.rebalancer.fullname" -}}
{{- printf "%s-rebalancer" (include "gpudaemon.fullname" .) -}}
{{- end -}}

{{- define "gpudaemon.rebalancer.serviceAccountName" -}}
{{- default (include "gpudaemon.rebalancer.fullname" .) .Values.rebalancer.serviceAccount.name -}}
{{- end -}}

{{/* The rebalancer's config: the user's, under the chart's keys (the scheduler whose
pods it makes room for, the Lease namespace, the label prefix, dry run). */}}
{{- define "gpudaemon.rebalancer.config" -}}
{{- $r := .Values.rebalancer -}}
{{- $managed := dict
  "labels" (dict "prefix" .Values.labelPrefix)
  "kubernetes" (dict "lease_namespace" .Release.Namespace)
  "extender" (dict "policy" .Values.extender.policy)
  "dra" (dict "enabled" (and (.Values.dra).enabled true))
  "remediation" (include "gpudaemon.remediation" . | fromYaml)
  "rebalance" (dict
    "dry_run" (not $r.apply)
    "listen" (printf "0.0.0.0:%d" (int $r.metricsPort))
    "scheduler_name" .Values.scheduler.name)
-}}
{{- if $r.namespaces }}
{{- $_ := set $managed.rebalance "namespaces" $r.namespaces }}
{{- end }}
{{- toYaml (mustMergeOverwrite (deepCopy $r.config) $managed) -}}
{{- end -}}

{{/* The values' string patterns (files/value-checks.json, generated by scripts/gen-docs
with values.schema.json, which keeps types, bounds and enums): a refusal names the key
and shows a good value, where Helm's schema message would print the whole regular
expression. templates/validate.yaml runs it. */}}
{{- define "gpudaemon.checkValues" -}}
{{- $file := .Files.Get "files/value-checks.json" | fromJson -}}
{{- range $file.checks -}}
{{- include "gpudaemon.checkValue" (dict "v" $.Values "path" .path "at" "" "kind" (get $file.kinds .kind)) -}}
{{- end -}}
{{- end -}}

{{/* One check: walk `path` from `v` (`*`: every item of a list or map); `at` is the key
walked so far, as the message names it. A value that is not a string is the schema's. */}}
{{- define "gpudaemon.checkValue" -}}
{{- if not .path -}}
{{- if and (kindIs "string" .v) (not (regexMatch .kind.pattern .v)) -}}
{{- fail (printf "%s: %s is not %s, e.g. %s" .at (squote .v) .kind.what (squote .kind.example)) -}}
{{- end -}}
{{- else -}}
{{- $key := first .path -}}
{{- $ctx := . -}}
{{- if and (eq $key "*") (kindIs "slice" .v) -}}
{{- range $i, $item := .v -}}
{{- include "gpudaemon.checkValue" (dict "v" $item "path" (rest $ctx.path) "at" (printf "%s[%d]" $ctx.at $i) "kind" $ctx.kind) -}}
{{- end -}}
{{- else if and (eq $key "*") (kindIs "map" .v) -}}
{{- range $k, $item := .v -}}
{{- include "gpudaemon.checkValue" (dict "v" $item "path" (rest $ctx.path) "at" (printf "%s.%s" $ctx.at $k) "kind" $ctx.kind) -}}
{{- end -}}
{{- else if and (kindIs "map" .v) (hasKey .v $key) -}}
{{- include "gpudaemon.checkValue" (dict "v" (get .v $key) "path" (rest .path) "at" (ternary $key (printf "%s.%s" .at $key) (eq .at "")) "kind" .kind) -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* The `remediation` section both the agent and the rebalancer read: the user's
settings under the one switch. */}}
{{- define "gpudaemon.remediation" -}}
{{- $r := .Values.remediation | default dict -}}
{{- toYaml (mustMergeOverwrite (deepCopy ($r.config | default dict)) (dict "reset_gpu" (and $r.resetGpu true))) -}}
{{- end -}}
