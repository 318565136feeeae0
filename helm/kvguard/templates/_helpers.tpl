{{/* Names */}}
{{- define "kvguard.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "kvguard.fullname" -}}
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

{{- define "kvguard.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* The pods' role: the serving workload with kvguard beside it, or kvguard alone per node. */}}
{{- define "kvguard.component" -}}
{{- if eq .Values.mode "daemonset" }}device-exporter{{ else }}serving{{ end }}
{{- end }}

{{- define "kvguard.selectorLabels" -}}
app.kubernetes.io/name: {{ include "kvguard.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: {{ include "kvguard.component" . }}
{{- end }}

{{- define "kvguard.runbookSelectorLabels" -}}
app.kubernetes.io/name: {{ include "kvguard.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: runbook
{{- end }}

{{/*
The runbook pages (templates/runbook.yaml): "true" where the rules render and runbook.enabled is true, or
null (the default) in mode cluster: one copy per cluster, beside the one copy of the rules.
kvguard.runbookUrl: their URL pattern for each alert's runbook_url (%s: the alert's name in lower case).
*/}}
{{- define "kvguard.runbookEnabled" -}}
{{- $on := .Values.runbook.enabled }}
{{- if kindIs "invalid" $on }}{{ $on = true }}{{ end }}
{{- if and $on (include "kvguard.rulesEnabled" .) }}true{{ end }}
{{- end }}

{{- define "kvguard.runbookUrl" -}}
{{- printf "http://%s-runbook.%s.svc/%%s.html" (include "kvguard.fullname" .) .Release.Namespace }}
{{- end }}

{{- define "kvguard.runbookLabels" -}}
helm.sh/chart: {{ include "kvguard.chart" . }}
{{ include "kvguard.runbookSelectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: kvguard
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{- define "kvguard.labels" -}}
helm.sh/chart: {{ include "kvguard.chart" . }}
{{ include "kvguard.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: kvguard
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{- define "kvguard.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "kvguard.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "kvguard.image" -}}
{{- $tag := default .Chart.AppVersion .Values.image.tag }}
{{- if .Values.image.digest }}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest }}
{{- else }}
{{- printf "%s:%s" .Values.image.repository $tag }}
{{- end }}
{{- end }}

{{/*
"true" where the release renders its Service (templates/service.yaml), else "".
*/}}
{{- define "kvguard.serviceEnabled" -}}
{{- if and .Values.service.enabled (has .Values.mode (list "sidecar" "daemonset" "leaderworkerset" "servingruntime")) (not (include "kvguard.knative" .)) }}true{{ end }}
{{- end }}

{{/*
"true" where mode servingruntime serves through Knative (KServe's Serverless / Knative deployment mode):
Knative admits one container port across all containers (the serving one) and no probes on the others
unless its multi-container-probing feature is on (knative/serving pkg/apis/serving/k8s_validation.go
98e5ef90:512-545 validateContainersPorts, :548-572 validateSidecarContainer). kvguard then declares no
port and no probe, and the PodMonitor scrapes its port by relabeling the address. servingruntime.yaml sets
__knative around the kvguard container, which it renders in mode sidecar.
*/}}
{{- define "kvguard.knative" -}}
{{- if or (index .Values "__knative") (and (eq .Values.mode "servingruntime") (has .Values.servingRuntime.deploymentMode (list "Serverless" "Knative"))) }}true{{ end }}
{{- end }}

{{- define "kvguard.scheme" -}}
{{- if or .Values.kvguard.tls.enabled (and .Values.kvguard.webConfig.enabled .Values.kvguard.webConfig.tls) }}https{{ else }}http{{ end }}
{{- end }}

{{/*
What is cluster-wide (the dashboard, the rules): "true" or "". Unset (null), on only in mode cluster,
so that N sidecar releases beside one cluster release make one dashboard and one rule set.
*/}}
{{- define "kvguard.rulesEnabled" -}}
{{- $on := .Values.prometheusRule.enabled }}
{{- if kindIs "invalid" $on }}{{ $on = eq .Values.mode "cluster" }}{{ end }}
{{- if and $on (ne .Values.mode "attach") }}true{{ end }}
{{- end }}

{{- define "kvguard.dashboardEnabled" -}}
{{- $on := .Values.dashboard.enabled }}
{{- if kindIs "invalid" $on }}{{ $on = eq .Values.mode "cluster" }}{{ end }}
{{- if and $on (ne .Values.mode "attach") }}true{{ end }}
{{- end }}

{{/*
The dashboard's uid, title suffix and ConfigMap key: "kvguard" and kvguard.json for the cluster's one
copy; a release's own copy gets its own (uid at most 40 characters, as Grafana allows), so that two
copies never overwrite each other in Grafana's sidecar folder or under one uid.
*/}}
{{- define "kvguard.dashboardUid" -}}
{{- if eq .Values.mode "cluster" }}kvguard{{ else }}{{ printf "kvguard-%s" (sha256sum (printf "%s/%s" .Release.Namespace (include "kvguard.fullname" .)) | trunc 12) }}{{ end }}
{{- end }}

{{- define "kvguard.dashboardKey" -}}
{{- if eq .Values.mode "cluster" }}kvguard.json{{ else }}{{ printf "kvguard-%s-%s.json" .Release.Namespace (include "kvguard.fullname" .) }}{{ end }}
{{- end }}

{{/* Checks on combinations of values that the schema cannot express clearly. */}}
{{- define "kvguard.validate" -}}
{{- if and (ne .Values.mode "cluster") (not .Values.image.repository) }}
{{- fail "image.repository is required: no kvguard image is published; build it from the repository's Dockerfile, push it, and set image.repository (README, \"Install\")" }}
{{- end }}
{{- if has .Values.mode (list "sidecar" "leaderworkerset") }}
{{- range .Values.serving.env }}
{{- if and (eq .name "VLLM_PLUGINS") (not (has "kvguard" (splitList "," (.value | default "" | nospace)))) }}
{{- fail (printf "serving.env sets VLLM_PLUGINS=%q without kvguard: vLLM would load no kvguard plugin and the probe would never start; add kvguard to the list" (.value | default "")) }}
{{- end }}
{{- end }}
{{- end }}
{{- if and (eq .Values.monitor.kind "ServiceMonitor") (include "kvguard.knative" .) }}
{{- fail (printf "servingRuntime.deploymentMode=%s: Knative admits no second container port, so no Service reaches kvguard; use monitor.kind=PodMonitor (it scrapes the undeclared port) or deploymentMode=RawDeployment" .Values.servingRuntime.deploymentMode) }}
{{- end }}
{{- if and (eq .Values.monitor.kind "ServiceMonitor") (not .Values.service.enabled) }}
{{- fail "monitor.kind=ServiceMonitor needs service.enabled=true (or use monitor.kind=PodMonitor)" }}
{{- end }}
{{- if and .Values.kvguard.tls.enabled (not .Values.kvguard.tls.secretName) }}
{{- fail "kvguard.tls.enabled needs kvguard.tls.secretName (a kubernetes.io/tls Secret)" }}
{{- end }}
{{- if and .Values.kvguard.webConfig.enabled (not .Values.kvguard.webConfig.secretName) }}
{{- fail "kvguard.webConfig.enabled needs kvguard.webConfig.secretName (a Secret holding the web config file)" }}
{{- end }}
{{- if and .Values.kvguard.webConfig.enabled .Values.kvguard.webConfig.tls .Values.kvguard.tls.enabled }}
{{- fail "kvguard.webConfig.tls and kvguard.tls.enabled both configure the server certificate: use one" }}
{{- end }}
{{- if and .Values.kvguard.basicAuth.enabled (not .Values.kvguard.basicAuth.secretName) }}
{{- fail "kvguard.basicAuth.enabled needs kvguard.basicAuth.secretName (a Secret with the username and password keys)" }}
{{- end }}
{{- if and (has .Values.mode (list "sidecar" "leaderworkerset")) (eq .Values.serving.name .Values.kvguard.name) }}
{{- fail (printf "serving.name and kvguard.name are both %q: two containers in one pod cannot share a name; rename one" .Values.serving.name) }}
{{- end }}
{{- if has .Values.mode (list "sidecar" "leaderworkerset" "servingruntime") }}
{{- range $kind := list "limits" "requests" }}
{{- range $name, $_ := (index ($.Values.serving.resources | default dict) $kind | default dict) }}
{{- if regexMatch (include "kvguard.acceleratorPattern" $) $name }}
{{- fail (printf "serving.resources.%s names the accelerator %s: set serving.accelerator.resource and .count instead (one vendor's resource, never merged with the default's)" $kind $name) }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}
{{- if eq .Values.mode "leaderworkerset" }}
{{- $l := .Values.leaderWorkerSet }}
{{- if ne (mul $l.tensorParallelSize $l.pipelineParallelSize) (mul $l.acceleratorsPerPod $l.size) }}
{{- fail (printf "leaderWorkerSet: tensorParallelSize x pipelineParallelSize = %d ranks, but acceleratorsPerPod x size = %d accelerators: vLLM needs one accelerator per rank" (mul $l.tensorParallelSize $l.pipelineParallelSize) (mul $l.acceleratorsPerPod $l.size)) }}
{{- end }}
{{- end }}
{{- if and (has .Values.mode (list "sidecar" "leaderworkerset")) .Values.sidecar.native (semverCompare "<1.29.0-0" .Capabilities.KubeVersion.Version) }}
{{- fail (printf "sidecar.native=true needs Kubernetes >= 1.29 (native sidecar containers); this cluster is %s: set sidecar.native=false" .Capabilities.KubeVersion.Version) }}
{{- end }}
{{- end }}

{{/* Extended resources that are accelerators (device plugins' names): serving.accelerator sets them, never
serving.resources, so that no default of one vendor merges into another vendor's pod. */}}
{{- define "kvguard.acceleratorPattern" -}}
^(nvidia\.com/(gpu|mig-.+)|huawei\.com/Ascend.+|amd\.com/gpu|habana\.ai/gaudi|intel\.com/gpu)$
{{- end }}

{{/*
The serving container's resources: serving.resources plus one accelerator in limits (the device plugin's
extended resource; its request defaults to the limit). Called with (dict "root" $ "count" N).
*/}}
{{- define "kvguard.servingResources" -}}
{{- $s := .root.Values.serving }}
{{- $resources := deepCopy ($s.resources | default dict) }}
{{- if gt (int .count) 0 }}
{{- $limits := index $resources "limits" | default dict }}
{{- $_ := set $limits $s.accelerator.resource (int .count) }}
{{- $_ := set $resources "limits" $limits }}
{{- end }}
{{- with $resources }}
resources:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{/* Pod identity through the downward API; CONTAINER_NAME has no downward-API field. */}}
{{- define "kvguard.identityEnv" -}}
- name: POD_NAME
  valueFrom:
    fieldRef:
      fieldPath: metadata.name
- name: POD_NAMESPACE
  valueFrom:
    fieldRef:
      fieldPath: metadata.namespace
- name: NODE_NAME
  valueFrom:
    fieldRef:
      fieldPath: spec.nodeName
{{- end }}

{{/* `kvguard serve` arguments (docs/metrics.md). */}}
{{- define "kvguard.args" -}}
{{- $k := .Values.kvguard -}}
{{- $sources := $k.sources -}}
{{- if not $sources -}}
{{- if has .Values.mode (list "sidecar" "leaderworkerset") }}{{ $sources = list "auto" }}{{ else }}{{ $sources = list .Values.daemonset.deviceSource }}{{ end -}}
{{- end -}}
- serve
- --listen={{ $k.listen }}
- --port={{ $k.port }}
- --log.level={{ $k.logLevel }}
- --log.format={{ $k.logFormat }}
{{- if has .Values.mode (list "sidecar" "leaderworkerset") }}
- --spool-dir={{ .Values.sidecar.spool.mountPath }}
{{- if and $k.vllmMetrics.enabled (ne (index .Values "__role" | default "") "worker") }}
- --vllm-metrics-url=http://127.0.0.1:{{ .Values.serving.port }}{{ $k.vllmMetrics.path }}
{{- end }}
{{- else if and (eq .Values.mode "daemonset") .Values.daemonset.spoolHostPath }}
- --spool-dir={{ .Values.sidecar.spool.mountPath }}
{{- end }}
{{- range $sources }}
- --source={{ . }}
{{- end }}
- --interval={{ $k.intervalSeconds }}
- --stale-after={{ $k.staleAfterSeconds }}
- --read-timeout={{ $k.readTimeoutSeconds }}
{{- if $k.failReadinessOnCritical }}
- --fail-readiness-on-critical
{{- end }}
{{- if $k.tls.enabled }}
- --tls-cert-file=/etc/kvguard/tls/tls.crt
- --tls-key-file=/etc/kvguard/tls/tls.key
{{- end }}
{{- if $k.basicAuth.enabled }}
- --basic-auth-user=$(KVGUARD_BASIC_AUTH_USER)
- --basic-auth-password-file=/etc/kvguard/basic-auth/{{ $k.basicAuth.passwordKey }}
{{- end }}
{{- if $k.webConfig.enabled }}
- --web.config.file=/etc/kvguard/web-config/{{ $k.webConfig.key }}
{{- if $k.webConfig.allowAuthOff }}
- --web.config.allow-auth-off
{{- end }}
{{- end }}
{{- if $k.runbookPublic }}
- --web.runbook-public
{{- end }}
{{- with $k.limits }}
- --max-ranks={{ int .maxRanks }}
- --max-engines={{ int .maxEngines }}
- --max-models={{ int .maxModels }}
- --max-pods={{ int .maxPods }}
- --max-label-length={{ int .maxLabelLength }}
- --max-metrics-bytes={{ int64 .maxMetricsBytes }}
{{- end }}
{{- range $k.extraArgs }}
- {{ . | quote }}
{{- end }}
{{- end }}

{{- define "kvguard.httpProbe" -}}
{{- $probe := index . 0 -}}
{{- $path := index . 1 -}}
{{- $scheme := index . 2 -}}
httpGet:
  path: {{ $path }}
  port: metrics
  scheme: {{ $scheme | upper }}
{{- range $key := list "initialDelaySeconds" "periodSeconds" "timeoutSeconds" "failureThreshold" }}
{{- if hasKey $probe $key }}
{{ $key }}: {{ index $probe $key }}
{{- end }}
{{- end }}
{{- end }}

{{/*
The kvguard container. In sidecar mode CONTAINER_NAME names the serving container: the memory
kvguard reports belongs to it, and Prometheus keeps kvguard's labels with honorLabels.
*/}}
{{- define "kvguard.container" -}}
{{- $k := .Values.kvguard -}}
{{- $scheme := include "kvguard.scheme" . -}}
- name: {{ $k.name }}
  image: {{ include "kvguard.image" . }}
  imagePullPolicy: {{ .Values.image.pullPolicy }}
  {{- if and (has .Values.mode (list "sidecar" "leaderworkerset")) .Values.sidecar.native }}
  restartPolicy: Always
  {{- end }}
  args:
    {{- include "kvguard.args" . | nindent 4 }}
  env:
    {{- include "kvguard.identityEnv" . | nindent 4 }}
    - name: CONTAINER_NAME
      value: {{ if has .Values.mode (list "sidecar" "leaderworkerset") }}{{ .Values.serving.name }}{{ else }}{{ $k.name }}{{ end }}
    {{- if index .Values "__role" }}
    {{- /* A LeaderWorkerSet group is one engine: its name and group index, the same on the leader and
           every worker pod (leaderworkerset.sigs.k8s.io labels, set on every pod of the group). */}}
    - name: LWS_NAME
      valueFrom:
        fieldRef:
          fieldPath: metadata.labels['leaderworkerset.sigs.k8s.io/name']
    - name: LWS_GROUP_INDEX
      valueFrom:
        fieldRef:
          fieldPath: metadata.labels['leaderworkerset.sigs.k8s.io/group-index']
    - name: KVGUARD_ENGINE_ID
      value: {{ $k.engineId | default "$(LWS_NAME)-$(LWS_GROUP_INDEX)" | quote }}
    {{- else if $k.engineId }}
    - name: KVGUARD_ENGINE_ID
      value: {{ $k.engineId | quote }}
    {{- end }}
    {{- if has .Values.mode (list "sidecar" "leaderworkerset") }}
    - name: KVGUARD_SPOOL_DIR
      value: {{ .Values.sidecar.spool.mountPath }}
    {{- end }}
    {{- if eq .Values.mode "daemonset" }}
    {{- if eq .Values.daemonset.deviceSource "nvml" }}
    - name: NVIDIA_VISIBLE_DEVICES
      value: {{ .Values.daemonset.nvml.visibleDevices | quote }}
    - name: NVIDIA_DRIVER_CAPABILITIES
      value: utility
    {{- else }}
    - name: ASCEND_VISIBLE_DEVICES
      value: {{ .Values.daemonset.npuSmi.visibleDevices | quote }}
    - name: LD_LIBRARY_PATH
      value: {{ printf "%s/lib64:%s/lib64/common:%s/lib64/driver:%s" .Values.daemonset.npuSmi.driverPath .Values.daemonset.npuSmi.driverPath .Values.daemonset.npuSmi.driverPath .Values.daemonset.npuSmi.dcmiPath }}
    {{- end }}
    {{- end }}
    {{- if $k.basicAuth.enabled }}
    - name: KVGUARD_BASIC_AUTH_USER
      valueFrom:
        secretKeyRef:
          name: {{ $k.basicAuth.secretName }}
          key: {{ $k.basicAuth.usernameKey }}
    {{- end }}
    {{- with $k.extraEnv }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  {{- if not (include "kvguard.knative" .) }}
  ports:
    - name: metrics
      containerPort: {{ $k.port }}
      protocol: TCP
  {{- if $k.startupProbe.enabled }}
  startupProbe:
    {{- include "kvguard.httpProbe" (list $k.startupProbe "/healthz" $scheme) | nindent 4 }}
  {{- end }}
  {{- if $k.livenessProbe.enabled }}
  livenessProbe:
    {{- include "kvguard.httpProbe" (list $k.livenessProbe "/healthz" $scheme) | nindent 4 }}
  {{- end }}
  {{- if $k.readinessProbe.enabled }}
  readinessProbe:
    {{- include "kvguard.httpProbe" (list $k.readinessProbe "/readyz" $scheme) | nindent 4 }}
  {{- end }}
  {{- end }}
  resources:
    {{- toYaml $k.resources | nindent 4 }}
  securityContext:
    {{- $securityContext := $k.securityContext }}
    {{- if include "kvguard.knative" . }}
    {{- /* Knative's webhook refuses a container securityContext field its SecurityContextMask does not copy,
    set even to false: privileged, allowPrivilegeEscalation, seLinuxOptions, procMount
    (knative/serving pkg/apis/serving/fieldmask.go, SecurityContextMask, at ec4128ad). */}}
    {{- $securityContext = pick $securityContext "capabilities" "readOnlyRootFilesystem" "runAsUser" "runAsGroup" "runAsNonRoot" }}
    {{- end }}
    {{- toYaml $securityContext | nindent 4 }}
  volumeMounts:
    - name: kvguard-tmp
      mountPath: /tmp
    {{- if has .Values.mode (list "sidecar" "leaderworkerset") }}
    - name: kvguard-spool
      mountPath: {{ .Values.sidecar.spool.mountPath }}
      readOnly: true
    {{- end }}
    {{- if and (eq .Values.mode "daemonset") .Values.daemonset.spoolHostPath }}
    - name: kvguard-spool
      mountPath: {{ .Values.sidecar.spool.mountPath }}
      readOnly: true
    {{- end }}
    {{- if and (eq .Values.mode "daemonset") (eq .Values.daemonset.deviceSource "npu-smi") }}
    - name: npu-smi
      mountPath: {{ .Values.daemonset.npuSmi.npuSmiPath }}
      readOnly: true
    - name: ascend-driver
      mountPath: {{ .Values.daemonset.npuSmi.driverPath }}
      readOnly: true
    - name: ascend-dcmi
      mountPath: {{ .Values.daemonset.npuSmi.dcmiPath }}
      readOnly: true
    {{- end }}
    {{- if $k.tls.enabled }}
    - name: kvguard-tls
      mountPath: /etc/kvguard/tls
      readOnly: true
    {{- end }}
    {{- if $k.basicAuth.enabled }}
    - name: kvguard-basic-auth
      mountPath: /etc/kvguard/basic-auth
      readOnly: true
    {{- end }}
    {{- if $k.webConfig.enabled }}
    - name: kvguard-web-config
      mountPath: /etc/kvguard/web-config
      readOnly: true
    {{- end }}
{{- end }}

{{/*
The init container that copies kvguard's plugin from the kvguard image into a shared volume: the
package and its dist-info (which carries the vllm.general_plugins entry point), for the serving
container's PYTHONPATH. The plugin needs nothing beyond the standard library and kvguard itself.
*/}}
{{- define "kvguard.pluginInitContainer" -}}
- name: kvguard-plugin
  image: {{ include "kvguard.image" . }}
  imagePullPolicy: {{ .Values.image.pullPolicy }}
  command:
    - python
    - -c
    - |
      import importlib.metadata, pathlib, shutil, sys
      dist, dest = importlib.metadata.distribution("kvguard"), pathlib.Path(sys.argv[1])
      for top in sorted({pathlib.PurePath(str(f)).parts[0] for f in dist.files}):
          if top == "kvguard" or (top.startswith("kvguard-") and top.endswith(".dist-info")):
              shutil.copytree(dist.locate_file(top), dest / top, dirs_exist_ok=True)
      print("kvguard plugin", dist.version, "copied to", dest)
    - {{ .Values.sidecar.plugin.mountPath }}
  resources:
    {{- toYaml .Values.kvguard.resources | nindent 4 }}
  securityContext:
    {{- toYaml .Values.kvguard.securityContext | nindent 4 }}
  volumeMounts:
    - name: kvguard-plugin
      mountPath: {{ .Values.sidecar.plugin.mountPath }}
{{- end }}

{{/* Volumes the kvguard container needs, in both modes. */}}
{{- define "kvguard.volumes" -}}
- name: kvguard-tmp
  emptyDir:
    sizeLimit: 16Mi
{{- if .Values.kvguard.tls.enabled }}
- name: kvguard-tls
  secret:
    secretName: {{ .Values.kvguard.tls.secretName }}
    items:
      - key: tls.crt
        path: tls.crt
      - key: tls.key
        path: tls.key
{{- end }}
{{- if .Values.kvguard.basicAuth.enabled }}
- name: kvguard-basic-auth
  secret:
    secretName: {{ .Values.kvguard.basicAuth.secretName }}
    items:
      - key: {{ .Values.kvguard.basicAuth.passwordKey }}
        path: {{ .Values.kvguard.basicAuth.passwordKey }}
{{- end }}
{{- if .Values.kvguard.webConfig.enabled }}
{{- /* Mounted whole and without subPath: the kubelet then updates the files in place on rotation. */}}
- name: kvguard-web-config
  secret:
    secretName: {{ .Values.kvguard.webConfig.secretName }}
{{- end }}
{{- end }}

{{/*
The start of the pod template both workloads share: pod metadata, then the head of the pod spec
(service account, pull secrets, priority and runtime class, grace period, pod securityContext).
The caller goes on with the containers under the same spec.
*/}}
{{- define "kvguard.podTemplateHead" -}}
metadata:
  labels:
    {{- include "kvguard.labels" . | nindent 4 }}
    {{- with .Values.podLabels }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  {{- with .Values.podAnnotations }}
  annotations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
spec:
  serviceAccountName: {{ include "kvguard.serviceAccountName" . }}
  automountServiceAccountToken: {{ .Values.serviceAccount.automountServiceAccountToken }}
  {{- with .Values.imagePullSecrets }}
  imagePullSecrets:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with .Values.priorityClassName }}
  priorityClassName: {{ . }}
  {{- end }}
  {{- with .Values.runtimeClassName }}
  runtimeClassName: {{ . }}
  {{- end }}
  terminationGracePeriodSeconds: {{ .Values.terminationGracePeriodSeconds }}
  {{- with .Values.podSecurityContext }}
  securityContext:
    {{- toYaml . | nindent 4 }}
  {{- end }}
{{- end }}

{{/* Where the pods may run: the pod spec's nodeSelector, tolerations and affinity (each only when set). */}}
{{- define "kvguard.podScheduling" -}}
{{- with .Values.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{/* The scrape endpoint shared by PodMonitor and ServiceMonitor. */}}
{{- define "kvguard.scrapeEndpoint" -}}
{{- $k := .Values.kvguard -}}
{{- $m := .Values.monitor -}}
{{- $knative := include "kvguard.knative" . -}}
- {{ if not $knative }}port: metrics
  {{ end }}path: /metrics
  scheme: {{ include "kvguard.scheme" . }}
  interval: {{ $m.interval }}
  scrapeTimeout: {{ $m.scrapeTimeout }}
  honorLabels: {{ $m.honorLabels }}
  {{- if or $k.tls.enabled (and $k.webConfig.enabled $k.webConfig.tls) }}
  tlsConfig:
    {{- if $k.tls.caSecretName }}
    ca:
      secret:
        name: {{ $k.tls.caSecretName }}
        key: {{ $k.tls.caKey }}
    {{- end }}
    {{- with $k.tls.serverName }}
    serverName: {{ . }}
    {{- end }}
    insecureSkipVerify: {{ $k.tls.insecureSkipVerify }}
  {{- end }}
  {{- if $k.basicAuth.enabled }}
  basicAuth:
    username:
      name: {{ $k.basicAuth.secretName }}
      key: {{ $k.basicAuth.usernameKey }}
    password:
      name: {{ $k.basicAuth.secretName }}
      key: {{ $k.basicAuth.passwordKey }}
  {{- end }}
  relabelings:
    {{- if $knative }}
    # Knative: kvguard declares no port, so Prometheus makes one port-free target for its container: the pod
    # IP alone, an IPv6 one bracketed by newer Prometheus releases and bare by older ones
    # (discovery/kubernetes/pod.go, "We don't have a port"); keep that one and add kvguard's port.
    - action: keep
      sourceLabels:
        - __meta_kubernetes_pod_container_name
      regex: {{ $k.name }}
    - action: replace
      sourceLabels:
        - __address__
      regex: \[?([^\[\]]*:[^\[\]]*)\]?
      targetLabel: __address__
      replacement: "[$1]:{{ $k.port }}"
    - action: replace
      sourceLabels:
        - __address__
      regex: ([^:\[\]]+)
      targetLabel: __address__
      replacement: "$1:{{ $k.port }}"
    {{- end }}
    # One job name whatever the release is called: the KVGuardExporterDown rule selects it.
    - action: replace
      targetLabel: job
      replacement: kvguard
    {{- if has .Values.mode (list "sidecar" "leaderworkerset" "servingruntime") }}
    # The container every series names: the serving container, whose memory kvguard reports (its
    # rank and device series say so through CONTAINER_NAME); up{} and the sidecar's own series too.
    - action: replace
      targetLabel: container
      replacement: {{ if eq .Values.mode "servingruntime" }}kserve-container{{ else }}{{ .Values.serving.name }}{{ end }}
    {{- end }}
    {{- with $m.relabelings }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  {{- with $m.metricRelabelings }}
  metricRelabelings:
    {{- toYaml . | nindent 4 }}
  {{- end }}
{{- end }}
