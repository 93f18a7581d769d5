{{/* Names and labels. Role helpers take (dict "root" $ "role" "router|prefill|decode"). */}}

{{- define "pdserve.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "pdserve.fullname" -}}
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

{{- define "pdserve.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "pdserve.selectorLabels" -}}
app.kubernetes.io/name: {{ include "pdserve.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "pdserve.labels" -}}
helm.sh/chart: {{ include "pdserve.chart" . }}
{{ include "pdserve.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{- define "pdserve.roleName" -}}
{{- printf "%s-%s" (include "pdserve.fullname" .root) .role | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "pdserve.roleSelectorLabels" -}}
{{ include "pdserve.selectorLabels" .root }}
app.kubernetes.io/component: {{ .role }}
{{- end -}}

{{- define "pdserve.roleLabels" -}}
{{ include "pdserve.labels" .root }}
app.kubernetes.io/component: {{ .role }}
{{- end -}}

{{- define "pdserve.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "pdserve.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "pdserve.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{/* The DNS name of a worker pool's headless Service: the router resolves it to the pods. */}}
{{- define "pdserve.poolHost" -}}
{{- printf "%s.%s.svc.%s" (include "pdserve.roleName" .) .root.Release.Namespace .root.Values.clusterDomain -}}
{{- end -}}

{{/* The Secret holding the Hugging Face token (key `token`). */}}
{{- define "pdserve.hfTokenSecret" -}}
{{- default (printf "%s-hf-token" (include "pdserve.fullname" .)) .Values.hfToken.existingSecret -}}
{{- end -}}

{{/* The Secret holding the token every internal call carries. */}}
{{- define "pdserve.internalTokenSecret" -}}
{{- default (printf "%s-internal-token" (include "pdserve.fullname" .)) .Values.internalToken.existingSecret -}}
{{- end -}}

{{/* --model: a preset name or a folder. */}}
{{- define "pdserve.model" -}}
{{- $m := .Values.model -}}
{{- if eq $m.source "preset" -}}
{{- required "model.preset is required when model.source is preset" $m.preset -}}
{{- else if or (eq $m.source "pvc") (eq $m.source "hostPath") -}}
{{- printf "%s/%s" $m.mountPath $m.path | trimSuffix "/" -}}
{{- else if eq $m.source "image" -}}
{{- required "model.path (absolute, in the image) is required when model.source is image" $m.path -}}
{{- else if eq $m.source "hub" -}}
{{- required "model.hub.repoId (org/name) is required when model.source is hub" $m.hub.repoId -}}
{{- else -}}
{{- fail (printf "model.source must be preset, hub, pvc, hostPath or image, not %q" $m.source) -}}
{{- end -}}
{{- end -}}

{{/* Flags every process takes from model: which model, and its name and context. */}}
{{- define "pdserve.modelArgs" -}}
{{- $m := .Values.model -}}
- --model={{ include "pdserve.model" . }}
{{- if and (eq $m.source "hub") $m.hub.revision }}
- --revision={{ $m.hub.revision }}
{{- end }}
{{- if $m.servedName }}
- --served-model-name={{ $m.servedName }}
{{- end }}
{{- if $m.maxModelLen }}
- --max-model-len={{ int64 $m.maxModelLen }}
{{- end }}
{{- end -}}

{{/* Flags every worker takes from model: (prefill and decode must agree on them). */}}
{{- define "pdserve.engineArgs" -}}
{{- $m := .root.Values.model -}}
{{ include "pdserve.modelArgs" .root }}
- --dtype={{ $m.dtype }}
- --page-size={{ $m.pageSize }}
- --kv-cache-dtype={{ $m.kvCacheDtype }}
{{- with $m.quantization }}
- --quantization={{ . }}
{{- end }}
{{- end -}}

{{/* A role's `settings` (flag name: value) as flags. Names are checked against the role's
command: files/flags.json lists each role's flags, made from the code's config dataclasses
(`make chart-flags`). Flags the chart sets from other values are refused here. */}}
{{- define "pdserve.settingsArgs" -}}
{{- $role := .role -}}
{{- $flags := index (.root.Files.Get "files/flags.json" | fromJson) $role -}}
{{- $common := list "host" "port" "metrics-port" "worker-id" "log-level" "shutdown-grace-s" "model" "revision" "served-model-name" "max-model-len" -}}
{{- $managed := dict "router" (concat $common (list "prefill-discovery" "decode-discovery" "tls-cert-file" "tls-key-file" "health-port" "http-port" "chat-template"))
                     "prefill" (concat $common (list "dtype" "page-size" "kv-cache-dtype" "quantization"))
                     "decode" (concat $common (list "dtype" "page-size" "kv-cache-dtype" "quantization" "kv-transfer" "kv-transfer-port" "advertise-host")) -}}
{{- range $name, $value := (index .root.Values $role).settings }}
{{- $kind := get $flags $name }}
{{- if not $kind }}
{{- fail (printf "%s.settings.%s: `pdserve %s` has no flag --%s (see `pdserve %s --help`)" $role $name $role $name $role) }}
{{- end }}
{{- if has $name (get $managed $role) }}
{{- fail (printf "%s.settings.%s: the chart sets --%s itself (from model, kvTransfer, tls, metrics or the ports)" $role $name $name) }}
{{- end }}
{{- if eq $kind "value" }}
{{- if kindIs "slice" $value }}
- --{{ $name }}={{ join "," $value }}
{{- else if and (kindIs "float64" $value) (eq (float64 (int64 $value)) $value) }}
- --{{ $name }}={{ int64 $value }}
{{- else }}
- --{{ $name }}={{ $value }}
{{- end }}
{{- else if $value }}
- --{{ $name }}
{{- else if eq $kind "toggle" }}
- --no-{{ $name }}
{{- end }}
{{- end }}
{{- end -}}

{{/* A role's Deployment. Takes root, role, args (a YAML list), ports (a YAML list of container
ports, the first named grpc) and probePort (where grpc.health.v1 answers in plaintext). */}}
{{- define "pdserve.deployment" -}}
{{- $root := .root -}}
{{- $values := index $root.Values .role -}}
{{- $model := $root.Values.model -}}
{{- /* A worker of N tensor-parallel ranks runs them on the N GPUs of its pod. */ -}}
{{- $ranks := int (get ($values.settings | default dict) "tensor-parallel-size" | default 1) -}}
{{- if and (hasKey $values "gpus") (gt (int $values.gpus) 0) (ne (int $values.gpus) $ranks) -}}
{{- fail (printf "%s.gpus: %v: a %s worker takes one GPU per tensor-parallel rank (settings.tensor-parallel-size: %d); run more replicas for more throughput" .role $values.gpus .role $ranks) -}}
{{- end -}}
{{- $hfToken := or $root.Values.hfToken.existingSecret $root.Values.hfToken.value -}}
apiVersion: apps/v1
kind: Deployment
metadata:
  name: {{ include "pdserve.roleName" . }}
  namespace: {{ $root.Release.Namespace }}
  labels:
    {{- include "pdserve.roleLabels" . | nindent 4 }}
spec:
  {{- if not $values.autoscaling.enabled }}
  replicas: {{ $values.replicas }}
  {{- end }}
  selector:
    matchLabels:
      {{- include "pdserve.roleSelectorLabels" . | nindent 6 }}
  template:
    metadata:
      labels:
        {{- include "pdserve.roleLabels" . | nindent 8 }}
      annotations:
        prometheus.io/scrape: "true"
        prometheus.io/port: {{ $root.Values.metrics.port | quote }}
    spec:
      serviceAccountName: {{ include "pdserve.serviceAccountName" $root }}
      {{- with $root.Values.imagePullSecrets }}
      imagePullSecrets:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      securityContext:
        {{- toYaml $root.Values.podSecurityContext | nindent 8 }}
      terminationGracePeriodSeconds: {{ $root.Values.terminationGracePeriodSeconds }}
      containers:
        - name: {{ .role }}
          image: {{ include "pdserve.image" $root }}
          imagePullPolicy: {{ $root.Values.image.pullPolicy }}
          command: ["pdserve", {{ .role | quote }}]
          args:
            - --host=0.0.0.0
            - --metrics-port={{ $root.Values.metrics.port }}
            - --worker-id=$(POD_NAME)
            - --log-level={{ $root.Values.logLevel }}
            - --shutdown-grace-s={{ sub $root.Values.terminationGracePeriodSeconds (add $root.Values.preStopSleepSeconds 5) }}
            {{- if $root.Values.internalToken.enabled }}
            - --internal-token-file=/etc/pdserve/internal/token
            {{- end }}
            {{- .args | nindent 12 }}
            {{- with $values.extraArgs }}
            {{- toYaml . | nindent 12 }}
            {{- end }}
          env:
            - name: POD_NAME
              valueFrom: {fieldRef: {fieldPath: metadata.name}}
            - name: POD_IP
              valueFrom: {fieldRef: {fieldPath: status.podIP}}
            # The root filesystem is read-only: caches (e.g. JIT kernels) go to /tmp.
            - name: HOME
              value: /tmp
            - name: XDG_CACHE_HOME
              value: /tmp/.cache
            - name: PYTHONDONTWRITEBYTECODE
              value: "1"
            - name: PYTHONUNBUFFERED
              value: "1"
            {{- if $model.hub.cacheClaimName }}
            - name: HF_HOME
              value: /var/cache/huggingface
            {{- end }}
            {{- if $hfToken }}
            - name: HF_TOKEN
              valueFrom:
                secretKeyRef:
                  name: {{ include "pdserve.hfTokenSecret" $root }}
                  key: token
            {{- end }}
            {{- if $root.Values.jitCache.claimName }}
            - name: FLASHINFER_WORKSPACE_BASE
              value: /var/cache/pdserve-jit
            - name: TRITON_CACHE_DIR
              value: /var/cache/pdserve-jit/triton
            {{- end }}
            {{- with $values.extraEnv }}
            {{- toYaml . | nindent 12 }}
            {{- end }}
          ports:
            {{- .ports | nindent 12 }}
            - name: metrics
              containerPort: {{ $root.Values.metrics.port }}
              protocol: TCP
          startupProbe:
            grpc: {port: {{ .probePort }}, service: pdserve.liveness}
            periodSeconds: 5
            failureThreshold: {{ div $root.Values.startupTimeoutSeconds 5 }}
          livenessProbe:
            grpc: {port: {{ .probePort }}, service: pdserve.liveness}
            periodSeconds: 10
            timeoutSeconds: 5
            failureThreshold: 3
          readinessProbe:
            grpc: {port: {{ .probePort }}}
            periodSeconds: 5
            timeoutSeconds: 5
            failureThreshold: 2
          lifecycle:
            preStop:
              exec:
                command: ["sleep", {{ $root.Values.preStopSleepSeconds | quote }}]
          {{- $resources := deepCopy ($values.resources | default dict) }}
          {{- if and (hasKey $values "gpus") $values.gpus }}
          {{- $_ := set $resources "limits" (merge (dict "nvidia.com/gpu" $values.gpus) ($resources.limits | default dict)) }}
          {{- end }}
          resources:
            {{- toYaml $resources | nindent 12 }}
          securityContext:
            {{- toYaml $root.Values.securityContext | nindent 12 }}
          volumeMounts:
            - name: tmp
              mountPath: /tmp
            {{- if $model.hub.cacheClaimName }}
            - name: hub-cache
              mountPath: /var/cache/huggingface
            {{- end }}
            {{- if $root.Values.jitCache.claimName }}
            - name: jit-cache
              mountPath: /var/cache/pdserve-jit
            {{- end }}
            {{- if or (eq $model.source "pvc") (eq $model.source "hostPath") }}
            - name: model
              mountPath: {{ $model.mountPath }}
              readOnly: true
            {{- end }}
            {{- if and (eq .role "router") $root.Values.tls.enabled }}
            - name: tls
              mountPath: /etc/pdserve/tls
              readOnly: true
            {{- end }}
            {{- if $root.Values.internalToken.enabled }}
            - name: internal-token
              mountPath: /etc/pdserve/internal
              readOnly: true
            {{- end }}
      volumes:
        - name: tmp
          emptyDir:
            sizeLimit: {{ $root.Values.tmpSizeLimit }}
        {{- if $model.hub.cacheClaimName }}
        - name: hub-cache
          persistentVolumeClaim:
            claimName: {{ $model.hub.cacheClaimName }}
        {{- end }}
        {{- if $root.Values.jitCache.claimName }}
        - name: jit-cache
          persistentVolumeClaim:
            claimName: {{ $root.Values.jitCache.claimName }}
        {{- end }}
        {{- if $root.Values.internalToken.enabled }}
        - name: internal-token
          secret:
            secretName: {{ include "pdserve.internalTokenSecret" $root }}
            defaultMode: 0400
        {{- end }}
        {{- if eq $model.source "pvc" }}
        - name: model
          persistentVolumeClaim:
            claimName: {{ required "model.pvc.claimName is required when model.source is pvc" $model.pvc.claimName }}
            readOnly: true
        {{- else if eq $model.source "hostPath" }}
        - name: model
          hostPath:
            path: {{ required "model.hostPath.path is required when model.source is hostPath" $model.hostPath.path }}
            type: Directory
        {{- end }}
        {{- if and (eq .role "router") $root.Values.tls.enabled }}
        - name: tls
          secret:
            secretName: {{ required "tls.secretName is required when tls.enabled" $root.Values.tls.secretName }}
        {{- end }}
      {{- with $values.nodeSelector }}
      nodeSelector:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $values.tolerations }}
      tolerations:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $values.affinity }}
      affinity:
        {{- toYaml . | nindent 8 }}
      {{- end }}
{{- end -}}

{{/* A role's HorizontalPodAutoscaler, if enabled. */}}
{{- define "pdserve.hpa" -}}
{{- $values := index .root.Values .role -}}
{{- if $values.autoscaling.enabled }}
apiVersion: autoscaling/v2
kind: HorizontalPodAutoscaler
metadata:
  name: {{ include "pdserve.roleName" . }}
  namespace: {{ .root.Release.Namespace }}
  labels:
    {{- include "pdserve.roleLabels" . | nindent 4 }}
spec:
  scaleTargetRef:
    apiVersion: apps/v1
    kind: Deployment
    name: {{ include "pdserve.roleName" . }}
  minReplicas: {{ $values.autoscaling.minReplicas }}
  maxReplicas: {{ $values.autoscaling.maxReplicas }}
  metrics:
    {{- if $values.autoscaling.metrics }}
    {{- toYaml $values.autoscaling.metrics | nindent 4 }}
    {{- else }}
    - type: Resource
      resource:
        name: cpu
        target:
          type: Utilization
          averageUtilization: {{ $values.autoscaling.targetCPUUtilizationPercentage }}
    {{- end }}
{{- end }}
{{- end -}}

{{/* A role's PodDisruptionBudget, if enabled. */}}
{{- define "pdserve.pdb" -}}
{{- $values := index .root.Values .role -}}
{{- if $values.podDisruptionBudget.enabled }}
apiVersion: policy/v1
kind: PodDisruptionBudget
metadata:
  name: {{ include "pdserve.roleName" . }}
  namespace: {{ .root.Release.Namespace }}
  labels:
    {{- include "pdserve.roleLabels" . | nindent 4 }}
spec:
  maxUnavailable: {{ $values.podDisruptionBudget.maxUnavailable }}
  selector:
    matchLabels:
      {{- include "pdserve.roleSelectorLabels" . | nindent 6 }}
{{- end }}
{{- end -}}
