{{- define "kestrel.fullname" -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "kestrel.labels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "kestrel.selectorLabels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{/* The gateway pods' own labels: the tritonserver Services and Deployment must not select them. */}}
{{- define "kestrel.gatewaySelectorLabels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}-gateway
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{/* The gateway's container; triton: the gRPC address (or a --triton-dns name:port) of its tritonservers. */}}
{{- define "kestrel.gatewayContainer" -}}
- name: gateway
  image: "{{ .root.Values.image.repository }}:{{ .root.Values.image.tag }}"
  imagePullPolicy: {{ .root.Values.image.pullPolicy }}
  args:
    - python3
    - -m
    - kestrel_backend.gateway
    - {{ .triton }}
    - --host=0.0.0.0  # (the pod's address: the Service reaches it there)
    - --port={{ .root.Values.gateway.port }}
    - --model-name={{ .root.Values.gateway.modelName | default .root.Values.model.name }}
    {{- if .root.Values.gateway.fetchImageUrls }}
    - --fetch-image-urls
    {{- end }}
    {{- with .root.Values.gateway.batch }}
    {{- if .enabled }}
    - --batch-data=/var/lib/kestrel/batch
    - --batch-lines-per-replica={{ .linesPerReplica }}
    - --batch-retention-h={{ .retentionHours }}
    - --batch-max-disk-gb={{ .maxDiskGb }}
    {{- end }}
    {{- end }}
  securityContext:
    {{- toYaml .root.Values.securityContext | nindent 4 }}
  ports:
    - { name: gateway, containerPort: {{ .root.Values.gateway.port }}, protocol: TCP }
  {{- $batch := .root.Values.gateway.batch }}
  {{- if or .root.Values.gateway.apiKeys.existingSecret (and $batch.enabled $batch.database.existingSecret) }}
  env:
    {{- with .root.Values.gateway.apiKeys.existingSecret }}
    - name: KESTREL_GATEWAY_API_KEYS
      valueFrom:
        secretKeyRef:
          name: {{ . }}
          key: {{ $.root.Values.gateway.apiKeys.key }}
    {{- end }}
    {{- if and $batch.enabled $batch.database.existingSecret }}
    - name: KESTREL_BATCH_DB
      valueFrom:
        secretKeyRef:
          name: {{ $batch.database.existingSecret }}
          key: {{ $batch.database.key }}
    {{- end }}
  {{- end }}
  {{- if $batch.enabled }}
  volumeMounts:
    - { name: batch-data, mountPath: /var/lib/kestrel/batch }
  {{- end }}
  livenessProbe:
    httpGet: { path: /healthz, port: gateway }
    periodSeconds: 15
  readinessProbe:
    httpGet: { path: /readyz, port: gateway }
    periodSeconds: 5
  {{- with .root.Values.gateway.resources }}
  resources:
    {{- toYaml . | nindent 4 }}
  {{- end }}
{{- end -}}

{{/* The Batch API's data folder, for a pod that runs the gateway; more than one gateway needs a shared database */}}
{{- define "kestrel.batchVolume" -}}
{{- $batch := .Values.gateway.batch -}}
{{- if and .Values.gateway.enabled $batch.enabled -}}
{{- $sidecar := eq .Values.gateway.mode "sidecar" -}}
{{- $gateways := ternary .Values.replicaCount .Values.gateway.replicaCount $sidecar -}}
{{- $many := or (gt (int $gateways) 1) (and $sidecar .Values.autoscaling.enabled) -}}
{{- if and $many (not $batch.database.existingSecret) -}}
{{- fail "gateway.batch with more than one gateway needs gateway.batch.database.existingSecret (PostgreSQL): SQLite is for one gateway" -}}
{{- end }}
- name: batch-data
  persistentVolumeClaim:
    claimName: {{ $batch.persistence.existingClaim | default (printf "%s-batch" (include "kestrel.fullname" .)) }}
{{- end -}}
{{- end -}}
