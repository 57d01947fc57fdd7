{{- /* Always ends in "-pipelinerl" (the release name is cut instead): job pods may not read the
Secrets named "<fullname>-auth" and the like, which the operator recognises by that ending. */ -}}
{{- define "pipelinerl.fullname" -}}
{{- printf "%s-pipelinerl" (.Release.Name | trunc 39 | trimSuffix "-") -}}
{{- end -}}

{{- define "pipelinerl.labels" -}}
app.kubernetes.io/name: pipelinerl
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "pipelinerl.natsUrl" -}}
{{- if .Values.nats.enabled -}}
{{- printf "nats://%s-nats.%s.svc:4222" (include "pipelinerl.fullname" .) .Release.Namespace -}}
{{- else -}}
{{- .Values.nats.externalUrl -}}
{{- end -}}
{{- end -}}

{{- define "pipelinerl.namespaces" -}}
{{- $all := prepend .Values.watchNamespaces .Release.Namespace | uniq -}}
{{- join "," $all -}}
{{- end -}}

{{- /* An image reference from {repository, tag, digest}: pinned by digest when one is given. */ -}}
{{- define "pipelinerl.image" -}}
{{- if .digest -}}
{{- printf "%s@%s" .repository .digest -}}
{{- else -}}
{{- printf "%s:%s" .repository .tag -}}
{{- end -}}
{{- end -}}

{{- /* The chart's JetStream store, per server: 90% of its volume (JetStream refuses writes before
the disk is full, never after). The operator refuses jobs it cannot hold. */ -}}
{{- define "pipelinerl.natsStoreBytes" -}}
{{- mul .Values.nats.storageGi 966367641 -}}
{{- end -}}

{{- /* The install's Secrets, by name: no job may reference them (the operator refuses it). */ -}}
{{- define "pipelinerl.installSecrets" -}}
{{- $f := include "pipelinerl.fullname" . -}}
{{- $names := list (printf "%s-auth" $f) (printf "%s-nats-accounts" $f) (printf "%s-nats-routes" $f) (printf "%s-operator-webhook" $f) -}}
{{- with .Values.auth.existingSecret }}{{ $names = append $names . }}{{ end -}}
{{- with .Values.nats.routesExistingSecret }}{{ $names = append $names . }}{{ end -}}
{{- join "," $names -}}
{{- end -}}

{{- /* Egress to the cluster DNS only (jobPolicy.dns): the rule the chart's pods and job pods share. */ -}}
{{- define "pipelinerl.dnsEgress" -}}
- to:
    - namespaceSelector: {matchLabels: {kubernetes.io/metadata.name: {{ .Values.jobPolicy.dns.namespace }}}}
      podSelector: {matchLabels: {{ toJson .Values.jobPolicy.dns.podLabels }}}
    {{- range .Values.jobPolicy.dns.cidrs }}
    - ipBlock: {cidr: {{ . | quote }}}
    {{- end }}
  ports: [{port: 53, protocol: UDP}, {port: 53, protocol: TCP}]
{{- end -}}

{{- /* Egress to the jobs' NATS: the chart's NATS pods, or nats.externalUrl's ports (at nats.externalCidrs). */ -}}
{{- define "pipelinerl.natsEgress" -}}
{{- if .Values.nats.enabled -}}
- to:
    - podSelector: {matchLabels: {app.kubernetes.io/instance: {{ .Release.Name }}, app.kubernetes.io/component: nats}}
  ports: [{port: 4222, protocol: TCP}]
{{- else -}}
- ports:
    {{- range splitList "," .Values.nats.externalUrl }}
    {{- $host := (urlParse (trim .)).host }}
    - {port: {{ if contains ":" $host }}{{ splitList ":" $host | last }}{{ else }}4222{{ end }}, protocol: TCP}
    {{- end }}
  {{- with .Values.nats.externalCidrs }}
  to:
    {{- range . }}
    - ipBlock: {cidr: {{ . | quote }}}
    {{- end }}
  {{- end }}
{{- end -}}
{{- end -}}

{{- /* The Secret holding the NATS route password (key `password`, URL-safe characters). */ -}}
{{- define "pipelinerl.natsRoutesSecret" -}}
{{- .Values.nats.routesExistingSecret | default (printf "%s-nats-routes" (include "pipelinerl.fullname" .)) -}}
{{- end -}}
