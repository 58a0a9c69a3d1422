{{- define "kvfabric.name" -}}
{{- .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "kvfabric.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "kvfabric.operatorName" -}}
{{- printf "%s-operator" (include "kvfabric.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "kvfabric.selectorLabels" -}}
app.kubernetes.io/name: {{ include "kvfabric.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end -}}

{{- define "kvfabric.labels" -}}
{{ include "kvfabric.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end -}}

{{- define "kvfabric.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{- define "kvfabric.agentImage" -}}
{{- printf "%s:%s" .Values.agent.image.repository (default .Chart.AppVersion .Values.agent.image.tag) -}}
{{- end -}}

{{/* Rules of the operator in every namespace it works in (ClusterRole, or a Role in watchNamespace). */}}
{{- define "kvfabric.operatorRules" -}}
# Watch fabrics; patch adds/removes the registry-cleanup finalizer.
- apiGroups: ["kvfabric.io"]
  resources: ["transferfabrics"]
  verbs: ["get", "list", "watch", "patch"]
- apiGroups: ["kvfabric.io"]
  resources: ["transferfabrics/status"]
  verbs: ["patch"]
# Owner references with blockOwnerDeletion need update on the owner's finalizers.
- apiGroups: ["kvfabric.io"]
  resources: ["transferfabrics/finalizers"]
  verbs: ["update"]
# Server-side apply creates (create) or updates (patch); DaemonSets of removed pools are deleted.
- apiGroups: ["apps"]
  resources: ["daemonsets"]
  verbs: ["list", "watch", "create", "patch", "delete"]
# Removed with their fabric by the garbage collector, so no delete.
- apiGroups: [""]
  resources: ["configmaps", "services", "serviceaccounts"]
  verbs: ["list", "watch", "create", "patch"]
# The agents' NetworkPolicy; deleted (get first, to check it is ours) when a fabric turns it off.
- apiGroups: ["networking.k8s.io"]
  resources: ["networkpolicies"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
# Why agents are not ready: the pods of an unready pool and its DaemonSet's FailedCreate events
# (Pod Security rejections, quota), read only then, never watched.
- apiGroups: [""]
  resources: ["pods", "events"]
  verbs: ["list"]
- apiGroups: ["events.k8s.io"]
  resources: ["events"]
  verbs: ["create", "patch"]
{{- end -}}

{{/* Comma-separated names of a list of {name: ...} references. */}}
{{- define "kvfabric.secretNames" -}}
{{- $names := list -}}
{{- range . -}}{{- $names = append $names .name -}}{{- end -}}
{{- join "," $names -}}
{{- end -}}

{{- define "kvfabric.csiName" -}}
{{- printf "%s-csi" (include "kvfabric.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "kvfabric.csiSelectorLabels" -}}
app.kubernetes.io/name: {{ include "kvfabric.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: csi-driver
{{- end -}}
