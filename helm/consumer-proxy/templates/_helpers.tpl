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
{{- $first := int .Values.metrics.port -}}
{{- $last := add $first (sub (int .Values.workers) 1) -}}
{{- if and (ge (int .Values.grpcHealth.port) $first) (le (int .Values.grpcHealth.port) $last) -}}
{{- fail (printf "grpcHealth.port %d clashes with the metrics ports %d-%d (metrics.port + worker index)" (int .Values.grpcHealth.port) $first $last) -}}
{{- end -}}
{{- end -}}
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
