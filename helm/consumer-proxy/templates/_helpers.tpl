{{/*
Names: the chart name, the release's full name (63 characters at most, a DNS label).
*/}}
{{- define "consumer-proxy.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "consumer-proxy.fullname" -}}
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
The metrics Service's name. A Service name is an RFC 1035 label (63 characters at most, a
letter first, no dots) while a release name may have 53 characters, dots and a digit first:
see consumer-proxy.labelName.
*/}}
{{- define "consumer-proxy.metricsServiceName" -}}
{{- include "consumer-proxy.labelName" (dict "context" . "suffix" "metrics") -}}
{{- end -}}

{{- define "consumer-proxy.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/*
Labels on every object; the selector labels never change over a release's life (a Deployment's
selector is immutable).
*/}}
{{- define "consumer-proxy.selectorLabels" -}}
app.kubernetes.io/name: {{ include "consumer-proxy.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "consumer-proxy.labels" -}}
helm.sh/chart: {{ include "consumer-proxy.chart" . }}
{{ include "consumer-proxy.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/component: proxy
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{- define "consumer-proxy.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "consumer-proxy.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "consumer-proxy.image" -}}
{{- $tag := default .Chart.AppVersion .Values.image.tag -}}
{{- if .Values.image.digest -}}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest -}}
{{- else -}}
{{- printf "%s:%s" .Values.image.repository $tag -}}
{{- end -}}
{{- end -}}

{{/*
The metrics port names, one per worker: worker i listens on metrics.port + i.
*/}}
{{- define "consumer-proxy.metricsPortName" -}}
{{- if eq (int .index) 0 -}}metrics{{- else -}}{{ printf "metrics-%d" (int .index) }}{{- end -}}
{{- end -}}

{{/*
The gRPC health port names, one per worker: worker i serves grpc.health.v1 on grpcHealth.port + i.
*/}}
{{- define "consumer-proxy.grpcHealthPortName" -}}
{{- if eq (int .index) 0 -}}grpc-health{{- else -}}{{ printf "grpc-health-%d" (int .index) }}{{- end -}}
{{- end -}}

{{/*
terminationGracePeriodSeconds: the proxy's drain grace (rounded up) plus the margin for the
final commit, leaving the group and closing channels.
*/}}
{{- define "consumer-proxy.terminationGracePeriodSeconds" -}}
{{- add (ceil .Values.shutdown.graceSeconds | int) (int .Values.shutdown.terminationMarginSeconds) -}}
{{- end -}}

{{/*
The onboarding config the proxy reads: kafka without secrets, the metrics and health ports,
the drain grace and the groups, in the proxy's own schema (consumer_proxy/config.py). The
checksum/config pod annotation hashes this text, so a change here rolls the pods.
*/}}
{{- define "consumer-proxy.config" -}}
# Rendered by the {{ include "consumer-proxy.chart" . }} chart from its values; edit the values,
# not this file. Kafka secrets reach the proxy as CONSUMER_PROXY_KAFKA__CLIENT__* variables.
kafka:
  bootstrap_servers: {{ .Values.kafka.bootstrap_servers | quote }}
  {{- with .Values.kafka.client }}
  client:
    {{- toYaml . | nindent 4 }}
  {{- end }}
metrics:
  enabled: true
  host: 0.0.0.0
  port: {{ int .Values.metrics.port }}
{{- if not (kindIs "invalid" .Values.grpcHealth.port) }}
health:
  grpc_port: {{ int .Values.grpcHealth.port }}
{{- end }}
shutdown_grace_s: {{ .Values.shutdown.graceSeconds }}
{{- with omit .Values.tracing "env" }}
tracing:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- if .Values.console.enabled }}
console:
  enabled: true
  dlq_scan_records: {{ int .Values.console.dlqScanRecords }}
{{- end }}
groups:
{{- range .Values.groups }}
  - name: {{ .name | quote }}
    {{- toYaml (omit . "name") | nindent 4 }}
{{- end }}
{{- end -}}

{{/*
Cross-field rules JSON Schema cannot say clearly; each fails the render with a plain message.
*/}}
{{- define "consumer-proxy.validate" -}}
{{- if and .Values.kafka.secretProperties (not .Values.kafka.existingSecret) -}}
{{- fail "kafka.secretProperties is set but kafka.existingSecret is empty: name the Secret that holds those keys" -}}
{{- end -}}
{{- range $prop, $_ := .Values.kafka.client -}}
{{- if regexMatch "password|secret|^ssl\\.key\\.pem$|^ssl_key$|^sasl\\.oauthbearer\\.config$" $prop -}}
{{- fail (printf "kafka.client.%s holds a secret and would be written into the ConfigMap: keep it in a Secret and list it in kafka.secretProperties (with kafka.existingSecret)" $prop) -}}
{{- end -}}
{{- end -}}
{{- range $prop, $_ := .Values.kafka.secretProperties -}}
{{- if hasKey $.Values.kafka.client $prop -}}
{{- fail (printf "kafka.client.%s is also in kafka.secretProperties: set it in one place" $prop) -}}
{{- end -}}
{{- end -}}
{{- if and .Values.autoscaling.enabled (gt (int .Values.autoscaling.minReplicas) (int .Values.autoscaling.maxReplicas)) -}}
{{- fail (printf "autoscaling.minReplicas (%d) is above autoscaling.maxReplicas (%d)" (int .Values.autoscaling.minReplicas) (int .Values.autoscaling.maxReplicas)) -}}
{{- end -}}
{{- if not (kindIs "invalid" .Values.grpcHealth.port) -}}
{{- /* Worker i serves metrics on metrics.port + i and gRPC health on grpcHealth.port + i. */ -}}
{{- $workers := int .Values.workers -}}
{{- $metrics := int .Values.metrics.port -}}
{{- $health := int .Values.grpcHealth.port -}}
{{- $gap := sub $health $metrics -}}
{{- if lt (ternary $gap (mul -1 $gap) (ge $gap 0)) $workers -}}
{{- fail (printf "grpcHealth.port %d clashes with the metrics ports %d-%d: with %d worker(s), worker i serves gRPC health on grpcHealth.port + i (%d-%d); move the ports at least %d apart" $health $metrics (add $metrics $workers -1) $workers $health (add $health $workers -1) $workers) -}}
{{- end -}}
{{- if gt (add $health $workers -1) 65535 -}}
{{- fail (printf "grpcHealth.port %d: with %d workers the last worker's port %d is above 65535" $health $workers (add $health $workers -1)) -}}
{{- end -}}
{{- end -}}
{{- with .Values.metrics.serviceMonitor -}}
{{- if and .enabled (gt (include "consumer-proxy.durationMs" .scrapeTimeout | int64) (include "consumer-proxy.durationMs" .interval | int64)) -}}
{{- fail (printf "metrics.serviceMonitor.scrapeTimeout (%s) is longer than metrics.serviceMonitor.interval (%s); Prometheus refuses a scrape timeout above the interval" .scrapeTimeout .interval) -}}
{{- end -}}
{{- end -}}
{{- include "consumer-proxy.validateOnboarding" . -}}
{{- $names := dict "config" true "tmp" true -}}
{{- range .Values.secretMounts -}}
{{- if hasKey $names .name -}}
{{- fail (printf "secretMounts: the volume name %q is used twice or is one of the chart's own (config, tmp)" .name) -}}
{{- end -}}
{{- $_ := set $names .name true -}}
{{- if or (eq (trimSuffix "/" .mountPath) "/tmp" "/etc/consumer-proxy/config") (hasPrefix "/etc/consumer-proxy/config/" .mountPath) (hasPrefix "/tmp/" .mountPath) -}}
{{- fail (printf "secretMounts[%s].mountPath %q overlaps the chart's own mounts (/etc/consumer-proxy/config, /tmp); use e.g. /etc/consumer-proxy/tls/<name>" .name .mountPath) -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/*
The onboarding config's rules across fields, as the proxy's validators (consumer_proxy/config.py)
apply them, so that `helm install` refuses what `consumer-proxy validate` would refuse. Field
shapes, ranges and syntax are in values.schema.json (generated from the same models); the
defaults and the proxy-owned properties come from _model.tpl (generated too). What only the
pod can check (TLS files exist) is left to `consumer-proxy validate` in the init container.
*/}}
{{- define "consumer-proxy.validateOnboarding" -}}
{{- $owned := include "consumer-proxy.proxyOwnedClientProperties" . | fromJsonArray -}}
{{- range $prop := keys (default (dict) .Values.kafka.client) | sortAlpha -}}
{{- if has $prop $owned -}}
{{- fail (printf "kafka.client.%s is set by the proxy and cannot be overridden (the proxy owns %s)" $prop (join ", " $owned)) -}}
{{- end -}}
{{- end -}}
{{- /* The proxy's _grace_within_poll_interval: the consumers are not polled while the calls
drain at shutdown, nor while a revoke waits; each wait keeps 30000 ms (REVOKE_MARGIN_MS) of
max.poll.interval.ms. */ -}}
{{- $pollMs := float64 (get (default (dict) .Values.kafka.client) "max.poll.interval.ms" | default 300000) -}}
{{- if gt (addf (mulf (float64 .Values.shutdown.graceSeconds) 1000) 30000) $pollMs -}}
{{- fail (printf "shutdown.graceSeconds (%v) leaves less than 30000 ms of kafka.client max.poll.interval.ms (%v ms): the consumers are not polled while the calls drain, and past it they leave the group before the drain's acks are committed; lower it or raise max.poll.interval.ms" .Values.shutdown.graceSeconds $pollMs) -}}
{{- end -}}
{{- $defaults := include "consumer-proxy.groupDefaults" . | fromJson -}}
{{- $names := dict -}}
{{- $owners := dict -}}
{{- range $i, $given := .Values.groups -}}
{{- $at := printf "groups[%d]" $i -}}
{{- if hasKey $names $given.name -}}
{{- fail (printf "%s.name: group name %q is already used by groups[%d]; each group needs a name of its own" $at $given.name (get $names $given.name)) -}}
{{- end -}}
{{- $_ := set $names $given.name $i -}}
{{- $group := mergeOverwrite (deepCopy $defaults) (deepCopy $given) -}}
{{- $backoff := $group.delivery.backoff -}}
{{- if lt (float64 $backoff.max_ms) (float64 $backoff.initial_ms) -}}
{{- fail (printf "%s.delivery.backoff.max_ms (%v) is below initial_ms (%v)" $at $backoff.max_ms $backoff.initial_ms) -}}
{{- end -}}
{{- if gt (addf (float64 $group.delivery.revoke_grace_ms) 30000) $pollMs -}}
{{- fail (printf "%s.delivery.revoke_grace_ms (%v) leaves less than 30000 ms of kafka.client max.poll.interval.ms (%v ms): the revoke wait runs inside the consumer's poll; lower it or raise max.poll.interval.ms" $at $group.delivery.revoke_grace_ms $pollMs) -}}
{{- end -}}
{{- $adaptive := $group.delivery.adaptive -}}
{{- if or (gt (float64 $adaptive.min) (float64 $adaptive.initial)) (gt (float64 $adaptive.initial) (float64 $adaptive.max)) -}}
{{- fail (printf "%s.delivery.adaptive: need min <= initial <= max, got %v, %v, %v" $at $adaptive.min $adaptive.initial $adaptive.max) -}}
{{- end -}}
{{- $dlq := $group.dlq.topic | default (printf "%s.dlq" $given.name) -}}
{{- $redrive := $group.dlq.redrive_topic | default (printf "%s.redrive" $given.name) -}}
{{- range $field := list "topic" "redrive_topic" -}}
{{- $topic := ternary $dlq $redrive (eq $field "topic") -}}
{{- if has $topic $given.topics -}}
{{- $isDefault := empty (get (default (dict) $given.dlq) $field) -}}
{{- fail (printf "%s.dlq.%s: %q%s is also a source topic of the group; the dlq.%s must be a topic of its own" $at $field $topic (ternary " (the default)" "" $isDefault) $field) -}}
{{- end -}}
{{- end -}}
{{- if eq $dlq $redrive -}}
{{- fail (printf "%s.dlq.redrive_topic: %q is also the DLQ topic; dlq.topic and dlq.redrive_topic must differ" $at $redrive) -}}
{{- end -}}
{{- /* The proxy's GroupConfig._dlq_not_a_source, the rest of it. */ -}}
{{- $delivery := $group.delivery -}}
{{- $tiers := list -}}
{{- range $n, $_ := default (list) $delivery.retry_topics -}}
{{- $tiers = append $tiers (printf "%s.retry.%d" $given.name (add $n 1)) -}}
{{- end -}}
{{- if and $tiers (ne (toString $delivery.ordering) "none") -}}
{{- fail (printf "%s.delivery.retry_topics: retry tiers need ordering none: a message waiting in a tier would let the later messages of its key go first (ordering is %q)" $at (toString $delivery.ordering)) -}}
{{- end -}}
{{- $long := $delivery.long_running -}}
{{- if $long -}}
{{- if le (float64 $long.max_processing_ms) (float64 $long.heartbeat_timeout_ms) -}}
{{- fail (printf "%s.delivery.long_running: max_processing_ms (%v) must be above heartbeat_timeout_ms (%v)" $at $long.max_processing_ms $long.heartbeat_timeout_ms) -}}
{{- end -}}
{{- $batch := get (default (dict) $given.delivery) "batch" -}}
{{- $batchOn := false -}}
{{- if kindIs "map" $batch -}}
{{- $batchOn = ne (toString (get $batch "mode")) "auto" -}}
{{- else if kindIs "string" $batch -}}
{{- $batchOn = eq $batch "always" -}}
{{- end -}}
{{- if $batchOn -}}
{{- fail (printf "%s.delivery.long_running: long-running calls push one message per streaming call: they cannot be combined with delivery.batch" $at) -}}
{{- end -}}
{{- if ge (float64 $delivery.revoke_grace_ms) (float64 $long.max_processing_ms) -}}
{{- fail (printf "%s.delivery.revoke_grace_ms: %v ms is not below long_running.max_processing_ms (%v ms)" $at $delivery.revoke_grace_ms $long.max_processing_ms) -}}
{{- end -}}
{{- if and (not (kindIs "invalid" $delivery.head_block_ms)) (le (float64 $delivery.head_block_ms) (float64 $long.max_processing_ms)) -}}
{{- fail (printf "%s.delivery.head_block_ms: %v ms is not above long_running.max_processing_ms (%v ms): a long call still heartbeating would be moved aside" $at $delivery.head_block_ms $long.max_processing_ms) -}}
{{- end -}}
{{- end -}}
{{- if and (not (kindIs "invalid" $delivery.head_block_ms)) (not $tiers) -}}
{{- fail (printf "%s.delivery.head_block_ms: head-of-line unblocking moves a message to a retry tier: it needs delivery.retry_topics" $at) -}}
{{- end -}}
{{- range $field := list "topic" "redrive_topic" -}}
{{- $topic := ternary $dlq $redrive (eq $field "topic") -}}
{{- if has $topic $tiers -}}
{{- fail (printf "%s.dlq.%s: %q is also a retry tier of the group; the dlq.%s must be a topic of its own" $at $field $topic $field) -}}
{{- end -}}
{{- end -}}
{{- range $tier := $tiers -}}
{{- if has $tier $given.topics -}}
{{- fail (printf "%s.delivery.retry_topics: %q (a retry tier) is also a source topic of the group" $at $tier) -}}
{{- end -}}
{{- end -}}
{{- /* The proxy's ProxyConfig._topics_of_one_group: each group's DLQ, redrive and retry
topics are its own. */ -}}
{{- $roles := list (list "dlq.topic" $dlq) (list "dlq.redrive_topic" $redrive) -}}
{{- range $tier := $tiers -}}
{{- $roles = append $roles (list "delivery.retry_topics" $tier) -}}
{{- end -}}
{{- range $role := $roles -}}
{{- $topic := index $role 1 -}}
{{- with get $owners $topic -}}
{{- fail (printf "%s.%s: %q is already the %s of groups[%v]; each group's DLQ, redrive and retry topics must be its own" $at (index $role 0) $topic (index . 1) (index . 0)) -}}
{{- end -}}
{{- $_ := set $owners $topic (list $i (index $role 0)) -}}
{{- end -}}
{{- with $group.service.tls -}}
{{- if ne (empty .cert_file) (empty .key_file) -}}
{{- fail (printf "%s.service.tls: cert_file and key_file go together (both for mTLS, or neither)" $at) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- /* A source topic may be another group's DLQ (read as data), not its redrive topic or a
retry tier: those only their group consumes. */ -}}
{{- range $i, $given := .Values.groups -}}
{{- range $topic := $given.topics -}}
{{- with get $owners $topic -}}
{{- if and (ne (index . 0) $i) (ne (index . 1) "dlq.topic") -}}
{{- fail (printf "groups[%d].topics: %q is the %s of groups[%v], which only that group consumes" $i $topic (index . 1) (index . 0)) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/*
A Prometheus duration of the schema's form (a number and one unit: ms, s, m or h) in ms.
*/}}
{{- define "consumer-proxy.durationMs" -}}
{{- $unit := regexReplaceAll "^[0-9]+" . "" -}}
{{- mul (regexFind "^[0-9]+" . | int64) (get (dict "ms" 1 "s" 1000 "m" 60000 "h" 3600000) $unit) -}}
{{- end -}}

{{/*
The proxy's environment: Kafka secrets as CONSUMER_PROXY_KAFKA__CLIENT__* from the existing
Secret, tracing's OTEL_* variables, then extraEnv and extraEnvFrom. Shared by the proxy, the init container and the test.
*/}}
{{- define "consumer-proxy.proxyEnv" -}}
{{- if or .Values.kafka.secretProperties .Values.extraEnv .Values.admin.existingSecret .Values.tracing.env }}
env:
  {{- with .Values.admin.existingSecret }}
  # The admin token (consumer-proxy guard release|hold), from an existing Secret.
  - name: CONSUMER_PROXY_ADMIN__TOKEN
    valueFrom:
      secretKeyRef:
        name: {{ . }}
        key: {{ $.Values.admin.tokenKey }}
  {{- end }}
  {{- range $prop, $key := .Values.kafka.secretProperties }}
  # librdkafka {{ $prop }}, merged into kafka.client by the proxy.
  - name: CONSUMER_PROXY_KAFKA__CLIENT__{{ $prop }}
    valueFrom:
      secretKeyRef:
        name: {{ $.Values.kafka.existingSecret }}
        key: {{ $key }}
  {{- end }}
  {{- range $name, $value := .Values.tracing.env }}
  - name: {{ $name }}
    value: {{ $value | quote }}
  {{- end }}
  {{- with .Values.extraEnv }}
  {{- toYaml . | nindent 2 }}
  {{- end }}
{{- end }}
{{- with .Values.extraEnvFrom }}
envFrom:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{/*
The config, /tmp and the Secret mounts, and the volumes behind them.
*/}}
{{- define "consumer-proxy.volumeMounts" -}}
# A directory mount, not subPath: secretMounts may sit beside it under
# /etc/consumer-proxy, never inside the read-only ConfigMap volume.
- name: config
  mountPath: /etc/consumer-proxy/config
  readOnly: true
- name: tmp
  mountPath: /tmp
{{- range .Values.secretMounts }}
- name: {{ .name }}
  mountPath: {{ .mountPath }}
  readOnly: true
{{- end }}
{{- end -}}

{{- define "consumer-proxy.volumes" -}}
- name: config
  configMap:
    name: {{ include "consumer-proxy.fullname" . }}
- name: tmp
  emptyDir:
    {{- with .Values.tmp.sizeLimit }}
    sizeLimit: {{ . }}
    {{- end }}
{{- range .Values.secretMounts }}
- name: {{ .name }}
  secret:
    secretName: {{ .secretName }}
    defaultMode: {{ .defaultMode | default 288 | int }}
    {{- with .items }}
    items:
      {{- toYaml . | nindent 6 }}
    {{- end }}
{{- end }}
{{- end -}}

{{/*
A container running `consumer-proxy validate` on the mounted config, as the proxy would read it
(same image, environment and mounts): the init container and the `helm test` Pod.
*/}}
{{- define "consumer-proxy.validateContainer" -}}
- name: validate-config
  image: {{ include "consumer-proxy.image" . }}
  imagePullPolicy: {{ .Values.image.pullPolicy }}
  args:
    - validate
    - --config
    - /etc/consumer-proxy/config/proxy.yaml
  # The validator's lines (field path and problem) become the termination message.
  terminationMessagePolicy: FallbackToLogsOnError
  {{- with include "consumer-proxy.proxyEnv" . | trim }}
  {{- . | nindent 2 }}
  {{- end }}
  {{- with .Values.resources }}
  resources:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  securityContext:
    {{- toYaml .Values.securityContext | nindent 4 }}
  volumeMounts:
    {{- include "consumer-proxy.volumeMounts" . | nindent 4 }}
{{- end -}}

{{/*
A name made of the full name and a suffix that fits an RFC 1035 label (63 characters, a letter
first, no dots): Service and Pod names. The full name is cut before the suffix is added.
*/}}
{{- define "consumer-proxy.labelName" -}}
{{- $base := include "consumer-proxy.fullname" .context | replace "." "-" -}}
{{- if regexMatch "^[0-9]" $base -}}
{{- $base = printf "cp-%s" $base -}}
{{- end -}}
{{- $room := sub 62 (len .suffix) | int -}}
{{- printf "%s-%s" ($base | trunc $room | trimSuffix "-") .suffix -}}
{{- end -}}
