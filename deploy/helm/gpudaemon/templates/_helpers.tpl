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

{{- define "gpudaemon.image" -}}
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

{{- define "gpudaemon.scheduler.serviceAccountName" -}}
{{- default (include "gpudaemon.scheduler.fullname" .) .Values.scheduler.serviceAccount.name -}}
{{- end -}}

{{/* The agent's ServiceAccount as the API server names its user. */}}
{{- define "gpudaemon.agent.username" -}}
{{- printf "system:serviceaccount:%s:%s" .Release.Namespace (include "gpudaemon.agent.serviceAccountName" .) -}}
{{- end -}}

{{- define "gpudaemon.influxdb.tokenDir" -}}/var/run/secrets/gpudaemon/influxdb{{- end -}}

{{/* The agent's config file: the user's agent.config under the keys the chart owns. */}}
{{- define "gpudaemon.agent.config" -}}
{{- $managed := dict
  "labels" (dict "prefix" .Values.labelPrefix "to" "apiserver")
  "metrics" (dict "listen" "0.0.0.0:9445")
  "kubernetes" (dict "lease_namespace" .Release.Namespace)
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

{{/* The extender reads the same config model; it needs the prefix and the Lease namespace. */}}
{{- define "gpudaemon.extender.config" -}}
{{- $managed := dict
  "labels" (dict "prefix" .Values.labelPrefix)
  "kubernetes" (dict "lease_namespace" .Release.Namespace)
  "extender" (dict "listen" (printf "0.0.0.0:%d" (int .Values.extender.port)) "policy" .Values.extender.policy)
-}}
{{- toYaml (mustMergeOverwrite (deepCopy .Values.extender.config) $managed) -}}
{{- end -}}

{{/* Whether a CRD-backed object renders: its switch is on, and the API exists or it is forced. */}}
{{- define "gpudaemon.hasAPI" -}}
{{- if and .values.enabled (or .values.force (.ctx.Capabilities.APIVersions.Has .api)) -}}true{{- end -}}
{{- end -}}
