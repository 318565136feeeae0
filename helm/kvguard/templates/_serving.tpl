{{/*
The serving pod template: the vLLM container with kvguard beside it (the sidecar mode's Deployment,
and each role of the leaderworkerset mode's LeaderWorkerSet). .Values.__role is "" for the Deployment,
"leader" or "worker" in a LeaderWorkerSet (set by leaderworkerset.yaml around the include): the
worker runs leaderWorkerSet.workerCommand and serves no HTTP (no probes, no vLLM /metrics to read), and
both roles name their engine by the LWS group (kvguard.container sets LWS_NAME and LWS_GROUP_INDEX).
*/}}
{{- define "kvguard.servingPodTemplate" -}}
{{- $s := .Values.serving }}
{{- $role := index .Values "__role" | default "" }}
{{- $command := $s.command }}
{{- $args := $s.args }}
{{- if $role }}
{{- $command = index .Values.leaderWorkerSet (printf "%sCommand" $role) }}
{{- $args = list }}
{{- end }}
{{- include "kvguard.podTemplateHead" . }}
  {{- if or .Values.sidecar.native .Values.sidecar.plugin.enabled }}
  initContainers:
    {{- if .Values.sidecar.plugin.enabled }}
    {{- include "kvguard.pluginInitContainer" . | nindent 4 }}
    {{- end }}
    {{- if .Values.sidecar.native }}
    {{- include "kvguard.container" . | nindent 4 }}
    {{- end }}
  {{- end }}
  containers:
    - name: {{ $s.name }}
      image: {{ printf "%s:%s" $s.image.repository $s.image.tag }}
      imagePullPolicy: {{ $s.image.pullPolicy }}
      {{- with $command }}
      command:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $args }}
      args:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      env:
        {{- include "kvguard.identityEnv" . | nindent 8 }}
        - name: CONTAINER_NAME
          value: {{ $s.name }}
        # Makes the kvguard vLLM plugin start the in-process probe, writing here.
        - name: KVGUARD_SPOOL_DIR
          value: {{ .Values.sidecar.spool.mountPath }}
        {{- if .Values.sidecar.plugin.enabled }}
        # kvguard's plugin, copied from the kvguard image by the kvguard-plugin init container:
        # its dist-info on the path is what vLLM's entry-point scan (vllm.general_plugins) finds.
        - name: PYTHONPATH
          value: {{ .Values.sidecar.plugin.mountPath }}
        {{- end }}
        {{- if $role }}
        # The engine's parallel sizes, for $(TENSOR_PARALLEL_SIZE) and $(PIPELINE_PARALLEL_SIZE) in the commands.
        - name: TENSOR_PARALLEL_SIZE
          value: {{ .Values.leaderWorkerSet.tensorParallelSize | quote }}
        - name: PIPELINE_PARALLEL_SIZE
          value: {{ .Values.leaderWorkerSet.pipelineParallelSize | quote }}
        {{- end }}
        {{- with $s.env }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      {{- with $s.envFrom }}
      envFrom:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- if ne $role "worker" }}
      ports:
        - name: http
          containerPort: {{ $s.port }}
          protocol: TCP
      {{- with $s.startupProbe }}
      startupProbe:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $s.livenessProbe }}
      livenessProbe:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $s.readinessProbe }}
      readinessProbe:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- end }}
      {{- $count := $s.accelerator.count }}
      {{- if $role }}
      {{- $count = .Values.leaderWorkerSet.acceleratorsPerPod }}
      {{- end }}
      {{- include "kvguard.servingResources" (dict "root" . "count" $count) | nindent 6 }}
      {{- with $s.securityContext }}
      securityContext:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      volumeMounts:
        - name: kvguard-spool
          mountPath: {{ .Values.sidecar.spool.mountPath }}
        {{- if .Values.sidecar.plugin.enabled }}
        - name: kvguard-plugin
          mountPath: {{ .Values.sidecar.plugin.mountPath }}
          readOnly: true
        {{- end }}
        {{- if $s.shm.enabled }}
        - name: dshm
          mountPath: /dev/shm
        {{- end }}
        {{- with $s.volumeMounts }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
    {{- if not .Values.sidecar.native }}
    {{- include "kvguard.container" . | nindent 4 }}
    {{- end }}
  volumes:
    - name: kvguard-spool
      emptyDir:
        medium: Memory
        sizeLimit: {{ .Values.sidecar.spool.sizeLimit }}
    {{- if .Values.sidecar.plugin.enabled }}
    - name: kvguard-plugin
      emptyDir:
        sizeLimit: 32Mi
    {{- end }}
    {{- if $s.shm.enabled }}
    - name: dshm
      emptyDir:
        medium: Memory
        sizeLimit: {{ $s.shm.sizeLimit }}
    {{- end }}
    {{- include "kvguard.volumes" . | nindent 4 }}
    {{- with $s.volumes }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  {{- include "kvguard.podScheduling" . | trim | nindent 2 }}
{{- end }}
