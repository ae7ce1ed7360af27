{{/*
What the operator may do, and no more. Children are never deleted by the operator
(owner references let the garbage collector do it), except ServiceMonitors it was asked to
stop managing and the RayClusters of retired worker generations.
*/}}
{{- define "kvrelay.managerRules" -}}
- apiGroups: [kvrelay.io]
  resources: [kvrelayservices]
  verbs: [get, list, watch, patch]
- apiGroups: [kvrelay.io]
  resources: [kvrelayservices/status, kvrelaypools/status]
  verbs: [get, patch]
# Children's ownerReferences set blockOwnerDeletion: where the OwnerReferencesPermission-
# Enforcement admission plugin is on, that needs update rights on the owner's finalizers.
- apiGroups: [kvrelay.io]
  resources: [kvrelayservices/finalizers]
  verbs: [update]
- apiGroups: [kvrelay.io]
  resources: [kvrelaypools]
  verbs: [get, list, watch, create, patch]
- apiGroups: [kvrelay.io]
  resources: [kvrelaypools/scale]
  verbs: [get, patch]
- apiGroups: [ray.io]
  resources: [rayclusters]
  verbs: [get, list, watch, create, patch, delete]
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
# A service's shared model cache (model.cache.shared): its claim and the Job that fills it.
- apiGroups: [""]
  resources: [persistentvolumeclaims]
  verbs: [get, list, watch, create, patch]
- apiGroups: [batch]
  resources: [jobs]
  verbs: [get, list, watch, create, patch]
# Each service's NetworkPolicy: only its own pods reach its Ray pods.
- apiGroups: [networking.k8s.io]
  resources: [networkpolicies]
  verbs: [get, list, watch, create, patch]
- apiGroups: ["", events.k8s.io]
  resources: [events]
  verbs: [create, patch]
- apiGroups: [kopf.dev]
  resources: [kopfpeerings]
  verbs: [get, list, watch, patch]
{{- if .Values.rbac.secrets }}
# get: a router's API key (the drain API needs it); create: a service's KV Secret and its
# Ray token Secret. No list or watch: the operator reads only the Secrets it names.
- apiGroups: [""]
  resources: [secrets]
  verbs: [get, create]
{{- end }}
{{- if .Values.rbac.serviceMonitors }}
- apiGroups: [monitoring.coreos.com]
  resources: [servicemonitors]
  verbs: [get, list, watch, create, patch, delete]
{{- end }}
{{- end }}
