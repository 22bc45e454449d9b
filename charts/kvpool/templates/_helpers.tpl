{{/* Names and labels shared by every template. */}}

{{- define "kvpool.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "kvpool.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "kvpool.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
app.kubernetes.io/name: {{ include "kvpool.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: kvpool
{{- end }}

{{- define "kvpool.operatorLabels" -}}
{{ include "kvpool.labels" . }}
app.kubernetes.io/component: operator
{{- end }}

{{- define "kvpool.selectorLabels" -}}
app.kubernetes.io/name: {{ include "kvpool.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end }}

{{- define "kvpool.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "kvpool.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "kvpool.image" -}}
{{- if .Values.image.digest }}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest }}
{{- else }}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}
{{- end }}

{{/* Peering is needed only when more than one operator replica runs. */}}
{{- define "kvpool.peering" -}}
{{- if gt (int .Values.replicaCount) 1 }}true{{ end }}
{{- end }}

{{/* Namespaced mode (the default): everything but watch.allNamespaces. */}}
{{- define "kvpool.namespaced" -}}
{{- if not .Values.watch.allNamespaces }}true{{ end }}
{{- end }}

{{/* The watched namespaces in namespaced mode, as JSON: watch.namespaces, or the release's own. */}}
{{- define "kvpool.watchedNamespaces" -}}
{{- if include "kvpool.namespaced" . }}
{{- default (list .Release.Namespace) .Values.watch.namespaces | toJson }}
{{- else }}[]{{ end }}
{{- end }}

{{/* The ClusterRole (pods list/watch) the operator binds each pool's router to, in the pool's namespace. */}}
{{- define "kvpool.routerDiscoveryRole" -}}
{{- printf "%s-router-discovery" (include "kvpool.fullname" .) }}
{{- end }}

{{/* Monitors look where the operator looks: the watched namespaces, or all of them. */}}
{{- define "kvpool.monitorNamespaces" -}}
namespaceSelector:
{{- if include "kvpool.namespaced" . }}
  matchNames:
    {{- include "kvpool.watchedNamespaces" . | fromJsonArray | toYaml | nindent 4 }}
{{- else }}
  any: true
{{- end }}
{{- end }}
