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
  securityContext:
    {{- toYaml .root.Values.securityContext | nindent 4 }}
  ports:
    - { name: gateway, containerPort: {{ .root.Values.gateway.port }}, protocol: TCP }
  {{- with .root.Values.gateway.apiKeys.existingSecret }}
  env:
    - name: KESTREL_GATEWAY_API_KEYS
      valueFrom:
        secretKeyRef:
          name: {{ . }}
          key: {{ $.root.Values.gateway.apiKeys.key }}
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
