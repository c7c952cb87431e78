{{/* Names and labels shared by every object. */}}
{{- define "gpuid-agent.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "gpuid-agent.fullname" -}}
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

{{- define "gpuid-agent.selectorLabels" -}}
app.kubernetes.io/name: {{ include "gpuid-agent.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "gpuid-agent.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "gpuid-agent.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/component: node-agent
{{- end }}

{{- define "gpuid-agent.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "gpuid-agent.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "gpuid-agent.image" -}}
{{- if .Values.image.digest }}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest }}
{{- else }}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}
{{- end }}

{{/* Whether a CRD-backed or version-gated object is rendered: enabled, and the cluster
serves the kind (Capabilities, filled from API discovery) or the user forces it. */}}
{{- define "gpuid-agent.wants" -}}
{{- $cfg := index . 0 }}{{- $ctx := index . 1 }}{{- $kind := index . 2 }}
{{- if and $cfg.enabled (or $cfg.force ($ctx.Capabilities.APIVersions.Has $kind)) }}true{{ end }}
{{- end }}

{{- /* DRA ResourceSlices are read when attribution is on, DRA is enabled and discovery
reports the ResourceSlice kind in a version the agent reads (or the user forces it). The kind,
not the bare group/version: offline rendering lists every group/version Helm knows of. */}}
{{- define "gpuid-agent.draSlices" -}}
{{- $cfg := .Values.dra }}
{{- $apis := .Capabilities.APIVersions }}
{{- $served := or ($apis.Has "resource.k8s.io/v1/ResourceSlice") ($apis.Has "resource.k8s.io/v1beta2/ResourceSlice") ($apis.Has "resource.k8s.io/v1beta1/ResourceSlice") }}
{{- if and .Values.podResources.enabled $cfg.enabled (or $cfg.force $served) }}true{{ end }}
{{- end }}

{{- define "gpuid-agent.ownNodePolicy" -}}
{{- $kind := "admissionregistration.k8s.io/v1/ValidatingAdmissionPolicy" }}
{{- $cfg := .Values.ownNodePolicy }}
{{- /* 1.30+: the v1 API, and the node name in pod-bound tokens (beta, on by default).
force skips API discovery (offline rendering), never the version. */}}
{{- $recent := semverCompare ">=1.30.0-0" .Capabilities.KubeVersion.Version }}
{{- if and $cfg.enabled $cfg.force (not $recent) }}
{{- fail (printf "ownNodePolicy.force needs Kubernetes 1.30 or newer (this is %s): set ownNodePolicy.enabled=false" .Capabilities.KubeVersion.Version) }}
{{- end }}
{{- if and $cfg.enabled $recent (or $cfg.force (.Capabilities.APIVersions.Has $kind)) }}true{{ end }}
{{- end }}

{{- define "gpuid-agent.labelPrefix" -}}
{{- .Values.nodeLabels.prefix | trimSuffix "/" }}
{{- end }}

{{- define "gpuid-agent.httpTokenDir" -}}/var/run/secrets/gpuid-agent/http{{- end }}
{{- define "gpuid-agent.httpCaDir" -}}/etc/gpuid-agent/http-ca{{- end }}
{{- define "gpuid-agent.otlpCaDir" -}}/etc/gpuid-agent/otlp-ca{{- end }}
{{- /* The OTLP settings apply to the log exporter and to the metrics push alike. */}}
{{- define "gpuid-agent.otlpUsed" -}}
{{- if or (has "otlp" .Values.exporters.types) .Values.exporters.otlp.metrics.enabled }}true{{ end }}
{{- end }}
{{- define "gpuid-agent.hostDir" -}}/host{{- end }}
{{- define "gpuid-agent.podResourcesDir" -}}/var/lib/kubelet/pod-resources{{- end }}
{{- define "gpuid-agent.spoolDir" -}}/var/lib/gpuid-agent/spool{{- end }}

{{/* Plain (non-secret) settings as NAME → string, structured values first, then
.Values.settings on top. Integers go through int64: Helm reads numbers as float64. */}}
{{- define "gpuid-agent.settingsEnv" -}}
{{- $v := .Values }}
{{- $env := dict }}
{{- $_ := set $env "CLUSTER_NAME" $v.clusterName }}
{{- $_ := set $env "LOG_LEVEL" $v.logLevel }}
{{- $_ := set $env "SERVER_PORT" ($v.agent.port | int64 | toString) }}
{{- $_ := set $env "COLLECT_INTERVAL" $v.agent.collectInterval }}
{{- $_ := set $env "HEARTBEAT_INTERVAL" $v.agent.heartbeatInterval }}
{{- $_ := set $env "METRICS_NAMING" $v.agent.metricsNaming }}
{{- $_ := set $env "EXPECTED_GPU_COUNT" ($v.agent.expectedGpuCount | int64 | toString) }}
{{- if $v.nvidia.libraryPath }}
{{- $_ := set $env "NVML_LIBRARY_PATH" $v.nvidia.libraryPath }}
{{- end }}
{{- $ex := $v.exporters }}
{{- $_ := set $env "EXPORTER_TYPE" (join "," $ex.types) }}
{{- $_ := set $env "BATCH_SIZE" ($ex.batchSize | int64 | toString) }}
{{- $_ := set $env "FLUSH_INTERVAL" $ex.flushInterval }}
{{- $_ := set $env "QUEUE_SIZE" ($ex.queueSize | int64 | toString) }}
{{- $_ := set $env "RETRY_COUNT" ($ex.retryCount | int64 | toString) }}
{{- $_ := set $env "TIMEOUT" $ex.timeout }}
{{- /* Leave the kubelet 5 s of the grace period after the agent's own flush deadline. */}}
{{- $_ := set $env "SHUTDOWN_GRACE" (printf "%ds" (max 1 (sub ($v.terminationGracePeriodSeconds | int64) 5))) }}
{{- if has "http" $ex.types }}
{{- $_ := set $env "HTTP_ENDPOINT" $ex.http.endpoint }}
{{- $_ := set $env "HTTP_TIMEOUT" $ex.http.timeout }}
{{- $_ := set $env "HTTP_GZIP" ($ex.http.gzip | toString) }}
{{- if $ex.http.authToken.secretName }}
{{- $_ := set $env "HTTP_AUTH_TOKEN_FILE" (printf "%s/%s" (include "gpuid-agent.httpTokenDir" .) $ex.http.authToken.key) }}
{{- end }}
{{- if $ex.http.caBundle.configMapName }}
{{- $_ := set $env "HTTP_CA_BUNDLE" (printf "%s/%s" (include "gpuid-agent.httpCaDir" .) $ex.http.caBundle.key) }}
{{- end }}
{{- end }}
{{- if has "postgres" $ex.types }}
{{- $pg := $ex.postgres }}
{{- $_ := set $env "POSTGRES_HOST" $pg.host }}
{{- $_ := set $env "POSTGRES_PORT" ($pg.port | int64 | toString) }}
{{- $_ := set $env "POSTGRES_DB" $pg.database }}
{{- $_ := set $env "POSTGRES_USER" $pg.user }}
{{- $_ := set $env "POSTGRES_SSLMODE" $pg.sslmode }}
{{- $_ := set $env "POSTGRES_TABLE" $pg.table }}
{{- $_ := set $env "POSTGRES_AUTO_MIGRATE" ($pg.autoMigrate | toString) }}
{{- $_ := set $env "POSTGRES_IDLE_TIMEOUT" ($pg.idleTimeout | toString) }}
{{- end }}
{{- if has "s3" $ex.types }}
{{- $s3 := $ex.s3 }}
{{- $_ := set $env "S3_BUCKET" $s3.bucket }}
{{- $_ := set $env "S3_PREFIX" $s3.prefix }}
{{- $_ := set $env "S3_PARTITION_PATTERN" $s3.partitionPattern }}
{{- $_ := set $env "S3_PATH_STYLE" ($s3.pathStyle | toString) }}
{{- $_ := set $env "S3_FORMAT" $s3.format }}
{{- $_ := set $env "S3_CSV_HEADER" ($s3.csvHeader | toString) }}
{{- $_ := set $env "S3_GZIP" ($s3.gzip | toString) }}
{{- if $s3.region }}
{{- $_ := set $env "S3_REGION" $s3.region }}
{{- end }}
{{- if $s3.endpointUrl }}
{{- $_ := set $env "S3_ENDPOINT_URL" $s3.endpointUrl }}
{{- end }}
{{- end }}
{{- $_ := set $env "PROCESS_ATTRIBUTION" ($v.processAttribution.enabled | toString) }}
{{- if $v.processAttribution.enabled }}
{{- $_ := set $env "HOST_PROC" (printf "%s/proc" (include "gpuid-agent.hostDir" .)) }}
{{- end }}
{{- if $v.kernelLog.enabled }}
{{- $_ := set $env "KERNEL_LOG" (printf "%s/dev/kmsg" (include "gpuid-agent.hostDir" .)) }}
{{- end }}
{{- $otlp := $ex.otlp }}
{{- if or (has "otlp" $ex.types) $otlp.metrics.enabled }}
{{- if $otlp.endpoint }}
{{- $_ := set $env "OTEL_EXPORTER_OTLP_ENDPOINT" $otlp.endpoint }}
{{- end }}
{{- if $otlp.logsEndpoint }}
{{- $_ := set $env "OTEL_EXPORTER_OTLP_LOGS_ENDPOINT" $otlp.logsEndpoint }}
{{- end }}
{{- $_ := set $env "OTEL_EXPORTER_OTLP_TIMEOUT" ($otlp.timeoutMs | int64 | toString) }}
{{- $_ := set $env "OTEL_EXPORTER_OTLP_COMPRESSION" $otlp.compression }}
{{- if $otlp.resourceAttributes }}
{{- $_ := set $env "OTEL_RESOURCE_ATTRIBUTES" $otlp.resourceAttributes }}
{{- end }}
{{- if $otlp.caBundle.configMapName }}
{{- $_ := set $env "OTEL_EXPORTER_OTLP_CERTIFICATE" (printf "%s/%s" (include "gpuid-agent.otlpCaDir" .) $otlp.caBundle.key) }}
{{- end }}
{{- if $otlp.metrics.enabled }}
{{- $_ := set $env "OTEL_METRICS_EXPORTER" "otlp" }}
{{- $_ := set $env "OTEL_METRIC_EXPORT_INTERVAL" ($otlp.metrics.intervalMs | int64 | toString) }}
{{- if $otlp.metrics.endpoint }}
{{- $_ := set $env "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT" $otlp.metrics.endpoint }}
{{- end }}
{{- end }}
{{- end }}
{{- if $v.spool.enabled }}
{{- $_ := set $env "SPOOL_DIR" (include "gpuid-agent.spoolDir" .) }}
{{- $_ := set $env "SPOOL_MAX_BYTES" ($v.spool.maxBytes | int64 | toString) }}
{{- /* The open-allocation state (STATE_DIR) shares the spool's hostPath, so a restarted
agent closes allocations that ended while it was down and sends no duplicate starts. */}}
{{- $_ := set $env "STATE_DIR" (printf "%s/state" (include "gpuid-agent.spoolDir" .)) }}
{{- end }}
{{- if $v.podResources.enabled }}
{{- $_ := set $env "POD_RESOURCES_SOCKET" (printf "%s/kubelet.sock" (include "gpuid-agent.podResourcesDir" .)) }}
{{- $_ := set $env "POD_RESOURCES_INTERVAL" $v.podResources.interval }}
{{- if $v.podResources.gpuResourceNames }}
{{- $_ := set $env "GPU_RESOURCE_NAMES" (join "," $v.podResources.gpuResourceNames) }}
{{- end }}
{{- if $v.podResources.podLabelAllowlist }}
{{- $_ := set $env "POD_LABEL_ALLOWLIST" (join "," $v.podResources.podLabelAllowlist) }}
{{- end }}
{{- $_ := set $env "DRA_RESOURCE_SLICES" (ternary "true" "false" (eq (include "gpuid-agent.draSlices" .) "true")) }}
{{- end }}
{{- $_ := set $env "LABELS" $v.nodeLabels.mode }}
{{- $_ := set $env "LABEL_PREFIX" (include "gpuid-agent.labelPrefix" .) }}
{{- $_ := set $env "LABEL_RESYNC_INTERVAL" $v.nodeLabels.resyncInterval }}
{{- $_ := set $env "LABEL_ANNOTATION" ($v.nodeLabels.annotation | toString) }}
{{- if $v.machineIdentity.dmiProductUuid.enabled }}
{{- $_ := set $env "DMI_PRODUCT_UUID_PATH" (printf "%s/sys/class/dmi/id/product_uuid" (include "gpuid-agent.hostDir" .)) }}
{{- else }}
{{- $_ := set $env "DMI_PRODUCT_UUID_PATH" "" }}
{{- end }}
{{- if $v.machineIdentity.machineId.enabled }}
{{- $_ := set $env "MACHINE_ID_PATH" (printf "%s/etc/machine-id" (include "gpuid-agent.hostDir" .)) }}
{{- else }}
{{- $_ := set $env "MACHINE_ID_PATH" "" }}
{{- end }}
{{- $_ := set $env "NODE_CONDITIONS" ($v.health.nodeConditions | toString) }}
{{- $_ := set $env "NODE_EVENTS" ($v.health.nodeEvents | toString) }}
{{- range $name, $value := $v.settings }}
{{- $_ := set $env $name (toString $value) }}
{{- end }}
{{- toYaml $env }}
{{- end }}

{{/*
The two scrape endpoints of the ServiceMonitor and the PodMonitor: (list monitorValues
gpuMetricsValues). Both scrape the same port, so the operator's target labels alone would
merge their `up` and scrape_* series: each gets its own `endpoint` label. /gpu/metrics drops
the agent's own pod, namespace and container target labels, so only a GPU's holders put a
`pod` on its series (one nobody holds has none), and honours the page's labels.
*/}}
{{- define "gpuid-agent.scrapeEndpoints" -}}
{{- $m := index . 0 -}}
{{- $gpu := index . 1 -}}
- port: http
  path: /metrics
  interval: {{ $m.interval }}
  scrapeTimeout: {{ $m.scrapeTimeout }}
  relabelings:
    # The node label the alert rules and dashboard group by.
    - sourceLabels: [__meta_kubernetes_pod_node_name]
      targetLabel: node
    - targetLabel: endpoint
      replacement: metrics
- port: http
  path: /gpu/metrics
  interval: {{ $m.interval }}
  scrapeTimeout: {{ $m.scrapeTimeout }}
  honorLabels: {{ $gpu.honorLabels }}
  relabelings:
    - sourceLabels: [__meta_kubernetes_pod_node_name]
      targetLabel: node
    - targetLabel: endpoint
      replacement: gpu-metrics
    - action: labeldrop
      regex: pod|namespace|container
{{- end }}
