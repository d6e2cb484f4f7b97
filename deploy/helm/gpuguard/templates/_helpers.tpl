{{/*
The objects mirror deploy/daemonset.yaml exactly with the default values (tests/test_helm.py), so
their labels are that file's labels: no helm.sh/chart or app.kubernetes.io/instance.
*/}}

{{- define "gpuguard.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "gpuguard.fullname" -}}
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

{{- define "gpuguard.labels" -}}
app.kubernetes.io/name: {{ include "gpuguard.name" . }}
{{- end -}}

{{- define "gpuguard.image" -}}
{{- printf "%s:%s" .Values.image.repository (.Values.image.tag | default .Chart.AppVersion | toString) -}}
{{- end -}}

{{/* The agent's uid and gid: the Dockerfile's USER. */}}
{{- define "gpuguard.uid" -}}65532{{- end -}}

{{/* The agent's default --listen port; another port is passed as GPUGUARD_LISTEN. */}}
{{- define "gpuguard.defaultPort" -}}9847{{- end -}}

{{/* Whether a value is set: not null (0 and false count as set). */}}
{{- define "gpuguard.isSet" -}}
{{- if not (kindIs "invalid" .) -}}{{- if ne (toString .) "" -}}true{{- end -}}{{- end -}}
{{- end -}}

{{/* The nodes the DaemonSet runs on as GPUGUARD_GPU_NODE_SELECTOR: one alternative per gpuNodes term
(";"-separated: the terms are ORed), each its expressions (Exists: key; In with one value: key=value) and
the nodeSelector's key=value pairs, comma-joined ("" when both are empty: every node). */}}
{{- define "gpuguard.gpuNodeSelector" -}}
{{- $pairs := list -}}
{{- range $k, $v := .Values.nodeSelector -}}
{{- $pairs = append $pairs (printf "%s=%s" $k (toString $v)) -}}
{{- end -}}
{{- $alternatives := list -}}
{{- range .Values.gpuNodes -}}
{{- if .matchFields -}}
{{- fail "gpuNodes: matchFields cannot be counted as a label selector; use matchExpressions" -}}
{{- end -}}
{{- $terms := list -}}
{{- range .matchExpressions -}}
{{- if eq .operator "Exists" -}}
{{- $terms = append $terms .key -}}
{{- else if and (eq .operator "In") (eq (len .values) 1) -}}
{{- $terms = append $terms (printf "%s=%s" .key (toString (index .values 0))) -}}
{{- else -}}
{{- fail (printf "gpuNodes: %s %s: only Exists, or In with one value, can be counted as a label selector" .key .operator) -}}
{{- end -}}
{{- end -}}
{{- $alternatives = append $alternatives (join "," (concat $terms $pairs)) -}}
{{- end -}}
{{- if not $alternatives -}}
{{- $alternatives = list (join "," $pairs) -}}
{{- end -}}
{{- join ";" $alternatives -}}
{{- end -}}

{{/*
"true" when the agent evicts the pods on faulty GPUs (evict.mode gpu-pods).
*/}}
{{- define "gpuguard.evicting" -}}
{{- if eq ((.Values.evict).mode | default "none") "gpu-pods" }}true{{ end }}
{{- end }}

{{/* A number of seconds as the agent's flag reads it: helm reads a values file's numbers as float64, whose
toString is 3.1536e+07 from 1e6 up; a whole number is written as an integer. */}}
{{- define "gpuguard.seconds" -}}
{{- if and (kindIs "float64" .) (eq . (float64 (int64 .))) -}}{{ int64 . }}{{- else -}}{{ toString . }}{{- end -}}
{{- end -}}
