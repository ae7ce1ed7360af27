{{/* The chart's name, overridable. */}}
{{- define "kvrelay.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 40 | trimSuffix "-" }}
{{- end }}

{{/* The release's base name for every object the chart creates. */}}
{{- define "kvrelay.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 50 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 50 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 50 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "kvrelay.operatorName" -}}
{{- printf "%s-operator" (include "kvrelay.fullname" .) }}
{{- end }}

{{/* Selector labels: stable across upgrades. */}}
{{- define "kvrelay.selectorLabels" -}}
app.kubernetes.io/name: {{ include "kvrelay.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end }}

{{/* Recommended labels of every object. */}}
{{- define "kvrelay.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
app.kubernetes.io/name: {{ include "kvrelay.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: kvrelay
{{- end }}

{{- define "kvrelay.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "kvrelay.operatorName" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "kvrelay.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{/* The operator's image (the Dockerfile's `operator` target), apart from the services'. */}}
{{- define "kvrelay.operatorImage" -}}
{{- printf "%s:%s" .Values.operator.image.repository (default .Chart.AppVersion .Values.operator.image.tag) }}
{{- end }}

{{/* The kopf peering object the operator's replicas share. */}}
{{- define "kvrelay.peeringName" -}}
{{- default (include "kvrelay.operatorName" .) .Values.operator.peeringName }}
{{- end }}
