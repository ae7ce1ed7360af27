{{/*
What the operator may do, and no more. Children are never deleted by the operator
(owner references let the garbage collector do it), except ServiceMonitors it was asked to
stop managing.
*/}}
{{- define "kvrelay.managerRules" -}}
- apiGroups: [kvrelay.io]
  resources: [kvrelayservices]
  verbs: [get, list, watch, patch]
- apiGroups: [kvrelay.io]
  resources: [kvrelayservices/status, kvrelaypools/status]
  verbs: [get, patch]
- apiGroups: [kvrelay.io]
  resources: [kvrelaypools]
  verbs: [get, list, watch, create, patch]
- apiGroups: [kvrelay.io]
  resources: [kvrelaypools/scale]
  verbs: [get, patch]
- apiGroups: [ray.io]
  resources: [rayclusters]
  verbs: [get, list, watch, create, patch]
- apiGroups: [apps]
  resources: [deployments]
  verbs: [get, list, watch, create, patch]
- apiGroups: [""]
  resources: [services]
  verbs: [get, list, watch, create, patch]
- apiGroups: [""]
  resources: [pods]
  verbs: [get, list, watch]
- apiGroups: [policy]
  resources: [poddisruptionbudgets]
  verbs: [get, list, watch, create, patch]
- apiGroups: ["", events.k8s.io]
  resources: [events]
  verbs: [create, patch]
{{- if .Values.rbac.serviceMonitors }}
- apiGroups: [monitoring.coreos.com]
  resources: [servicemonitors]
  verbs: [get, list, watch, create, patch, delete]
{{- end }}
{{- end }}
