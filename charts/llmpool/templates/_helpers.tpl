{{/* Names and labels shared by the chart's templates. */}}

{{- define "llmpool.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* The release's full name: names the operator Deployment, ServiceAccount, Roles, peering. */}}
{{- define "llmpool.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/*
Cluster-scoped objects (ClusterRole, ClusterRoleBinding, ClusterKopfPeering) carry the release
namespace too, so that releases of the same name in two namespaces do not collide.
*/}}
{{- define "llmpool.clusterName" -}}
{{- printf "%s-%s" (include "llmpool.fullname" .) .Release.Namespace | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "llmpool.selectorLabels" -}}
app.kubernetes.io/name: {{ include "llmpool.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end -}}

{{- define "llmpool.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "llmpool.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{- define "llmpool.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "llmpool.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "llmpool.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{- define "llmpool.peeringName" -}}
{{- default (include "llmpool.clusterName" .) .Values.peering.name -}}
{{- end -}}

{{/* Whether the operator serves every namespace (ClusterRole) or only watchNamespaces (Roles). */}}
{{- define "llmpool.clusterwide" -}}
{{- if not .Values.watchNamespaces -}}true{{- end -}}
{{- end -}}

{{/* The rule sets generated from operator/rbac.py. */}}
{{- define "llmpool.rbacRules" -}}
{{- .Files.Get "files/operator-rbac.yaml" | fromYaml | toJson -}}
{{- end -}}

{{/* Labels of the engine objects the operator creates (operator/naming.py). */}}
{{- define "llmpool.engineSelector" -}}
app.kubernetes.io/name: llmpool-engine
{{- end -}}

{{/* The fleet key's Secret (fleet-key.yaml), mounted into the operator and the gateway. */}}
{{- define "llmpool.fleetKeySecretName" -}}
{{- printf "%s-fleet-key" (include "llmpool.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Where the fleet key is mounted (LLMPOOL_FLEET_KEY_FILE is this plus /fleet-key). */}}
{{- define "llmpool.fleetKeyDir" -}}
/var/run/secrets/llmpool/fleet-key
{{- end -}}
