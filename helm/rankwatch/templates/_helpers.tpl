{{/* Names: <release>-rankwatch unless the release name already says rankwatch. */}}
{{- define "rankwatch.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "rankwatch.fullname" -}}
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

{{- define "rankwatch.collectorName" -}}
{{- printf "%s-collector" (include "rankwatch.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* A Job's pods get "<job>-<index>" hostnames: keep room for the index under 63 characters. */}}
{{- define "rankwatch.jobName" -}}
{{- default (printf "%s-train" (include "rankwatch.fullname" .)) .Values.job.name | trunc 50 | trimSuffix "-" }}
{{- end }}

{{/* part-of: the alert rules select the scrape job "rankwatch*"; the monitors take the job name from it. */}}
{{- define "rankwatch.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{ include "rankwatch.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: rankwatch
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{- define "rankwatch.selectorLabels" -}}
app.kubernetes.io/name: {{ include "rankwatch.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "rankwatch.collectorSelectorLabels" -}}
{{ include "rankwatch.selectorLabels" . }}
app.kubernetes.io/component: collector
{{- end }}

{{- define "rankwatch.trainingSelectorLabels" -}}
{{ include "rankwatch.selectorLabels" . }}
app.kubernetes.io/component: training
{{- end }}

{{- define "rankwatch.tokenSecretName" -}}
{{- default (printf "%s-token" (include "rankwatch.fullname" .)) .Values.token.existingSecret }}
{{- end }}

{{- define "rankwatch.image" -}}
{{- $tag := default .context.Chart.AppVersion .image.tag -}}
{{- if .image.digest }}{{ printf "%s@%s" .image.repository .image.digest }}{{ else }}{{ printf "%s:%s" .image.repository $tag }}{{ end }}
{{- end }}

{{- define "rankwatch.collectorURL" -}}
{{- if .Values.job.collectorURL }}
{{- .Values.job.collectorURL }}
{{- else if .Values.collector.enabled }}
{{- printf "http://%s.%s.svc:%d" (include "rankwatch.collectorName" .) .Release.Namespace (int .Values.collector.service.port) }}
{{- else }}
{{- fail "job.collectorURL is required when collector.enabled is false (point it at the release that runs the collector)" }}
{{- end }}
{{- end }}

{{/* RANKWATCH_<KEY> variables of a settings map. */}}
{{- define "rankwatch.settingsEnv" -}}
{{- range $key, $value := . }}
- name: {{ printf "RANKWATCH_%s" ($key | upper | replace "-" "_") }}
  value: {{ $value | toString | quote }}
{{- end }}
{{- end }}

{{- define "rankwatch.tokenEnv" -}}
- name: RANKWATCH_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ include "rankwatch.tokenSecretName" . }}
      key: {{ .Values.token.key }}
{{- end }}

{{/*
The run id: fixed by job.runId, else "<job name>-<uid of the Job object>" so that re-running a job
of the same name never mixes two runs in the collector. Job-based kinds (indexed, jobset,
trainjob) label their pods with the Job's UID; PyTorchJob pods have no such label, the
launcher then derives the id from the rendezvous.
*/}}
{{- define "rankwatch.runIdEnv" -}}
{{- if .Values.job.runId }}
- name: RANKWATCH_RUN_ID
  value: {{ .Values.job.runId | quote }}
{{- else if has .Values.job.kind (list "indexed" "jobset" "trainjob") }}
- name: RANKWATCH_JOB_UID
  valueFrom:
    fieldRef:
      fieldPath: metadata.labels['batch.kubernetes.io/controller-uid']
- name: RANKWATCH_RUN_ID
  value: {{ printf "%s-$(RANKWATCH_JOB_UID)" (include "rankwatch.jobName" .) | quote }}
{{- end }}
{{- end }}

{{/* rankwatch's own settings for the launcher and the agents of a training pod. */}}
{{/* embedded mode: the launcher's collector serves /metrics on all interfaces for the PodMonitor, with the token. */}}
{{- define "rankwatch.jobEnv" -}}
{{- $job := .Values.job }}
{{- include "rankwatch.runIdEnv" . }}
{{- if eq $job.collectorMode "standalone" }}
- name: RANKWATCH_COLLECTOR
  value: {{ include "rankwatch.collectorURL" . | quote }}
{{- include "rankwatch.tokenEnv" . | nindent 0 }}
{{- else }}
{{- if ne (int $job.nnodes) 1 }}
{{- fail "job.collectorMode embedded needs job.nnodes 1: every node's launcher would hold only its own ranks" }}
{{- end }}
- name: RANKWATCH_BIND
  value: "0.0.0.0"
- name: RANKWATCH_METRICS_PORT
  value: {{ $job.metricsPort | quote }}
{{- include "rankwatch.tokenEnv" . | nindent 0 }}
{{- end }}
- name: RANKWATCH_RUN_DIR
  value: {{ $job.runDir | quote }}
{{- if $job.hangTimeout }}
- name: RANKWATCH_HANG_TIMEOUT
  value: {{ $job.hangTimeout | toString | quote }}
{{- end }}
- name: RANKWATCH_ON_HANG
  value: {{ $job.onHang | quote }}
{{- with include "rankwatch.settingsEnv" $job.settings | trim }}
{{ . }}
{{- end }}
- name: PYTHONUNBUFFERED
  value: "1"
{{- end }}

{{/* The training command: `rankwatch run` with no torchrun flag (PET_* variables carry them). */}}
{{- define "rankwatch.jobCommand" -}}
- rankwatch
- run
{{- if .Values.job.module }}
- -m
{{- end }}
- {{ .Values.job.script | quote }}
{{- range .Values.job.args }}
- {{ . | toString | quote }}
{{- end }}
{{- end }}

{{- define "rankwatch.jobResources" -}}
{{- $res := deepCopy (default dict .Values.job.resources) }}
{{- if gt (int .Values.job.gpus) 0 }}
{{- $limits := deepCopy (default dict $res.limits) }}
{{- $_ := set $limits .Values.job.gpuResource (int .Values.job.gpus) }}
{{- $_ := set $res "limits" $limits }}
{{- end }}
{{- toYaml $res }}
{{- end }}

{{- define "rankwatch.jobImage" -}}
{{- if not .Values.job.image.repository }}
{{- fail "job.image.repository is required: an image with PyTorch and rankwatch (see deploy/train.Dockerfile)" }}
{{- end }}
{{- include "rankwatch.image" (dict "image" .Values.job.image "context" .) }}
{{- end }}

{{- define "rankwatch.jobVolumeMounts" -}}
- name: rankwatch-run
  mountPath: {{ .Values.job.runDir }}
{{- if .Values.job.shmSize }}
- name: dshm
  mountPath: /dev/shm
{{- end }}
{{- with .Values.job.volumeMounts }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{- define "rankwatch.jobVolumes" -}}
- name: rankwatch-run
{{ toYaml .Values.job.runDirVolume | indent 2 }}
{{- if .Values.job.shmSize }}
- name: dshm
  emptyDir:
    medium: Memory
    sizeLimit: {{ .Values.job.shmSize }}
{{- end }}
{{- with .Values.job.volumes }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* Job metadata labels: the chart's, the Kueue queue, the user's. */}}
{{- define "rankwatch.jobLabels" -}}
{{ include "rankwatch.labels" . }}
app.kubernetes.io/component: training
{{- with .Values.job.queueName }}
kueue.x-k8s.io/queue-name: {{ . | quote }}
{{- end }}
{{- with .Values.job.labels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{- define "rankwatch.jobPodLabels" -}}
{{ include "rankwatch.trainingSelectorLabels" . }}
app.kubernetes.io/part-of: rankwatch
{{- with .Values.job.podLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* The training container (every kind but rayjob and trainjob, which shape their own). */}}
{{- define "rankwatch.trainingContainer" -}}
- name: {{ .containerName | default "trainer" }}
  image: {{ include "rankwatch.jobImage" .root | quote }}
  imagePullPolicy: {{ .root.Values.job.image.pullPolicy }}
  command:
{{ include "rankwatch.jobCommand" .root | indent 4 }}
  env:
{{ include "rankwatch.jobEnv" .root | trim | indent 4 }}
{{- with .extraEnv }}
{{ . | indent 4 }}
{{- end }}
{{- with .root.Values.job.env }}
{{ toYaml . | indent 4 }}
{{- end }}
{{- with .ports }}
  ports:
{{ . | indent 4 }}
{{- end }}
{{- if eq .root.Values.job.collectorMode "embedded" }}
{{- if not .ports }}
  ports:
{{- end }}
    - name: metrics
      containerPort: {{ .root.Values.job.metricsPort }}
      protocol: TCP
{{- end }}
  resources:
{{ include "rankwatch.jobResources" .root | indent 4 }}
{{- with .root.Values.job.securityContext }}
  securityContext:
{{ toYaml . | indent 4 }}
{{- end }}
  volumeMounts:
{{ include "rankwatch.jobVolumeMounts" .root | indent 4 }}
{{- end }}

{{/* Pod-level fields shared by every kind (placement, scheduling, security, volumes). */}}
{{- define "rankwatch.trainingPodSpec" -}}
{{- $job := .Values.job }}
{{- with $job.imagePullSecrets }}
imagePullSecrets:
{{ toYaml . }}
{{- end }}
{{- with $job.serviceAccountName }}
serviceAccountName: {{ . }}
{{- end }}
{{- with $job.schedulerName }}
schedulerName: {{ . }}
{{- end }}
{{- with $job.priorityClassName }}
priorityClassName: {{ . }}
{{- end }}
{{- with $job.nodeSelector }}
nodeSelector:
{{ toYaml . | indent 2 }}
{{- end }}
{{- with $job.tolerations }}
tolerations:
{{ toYaml . }}
{{- end }}
{{- with $job.affinity }}
affinity:
{{ toYaml . | indent 2 }}
{{- end }}
{{- with $job.podSecurityContext }}
securityContext:
{{ toYaml . | indent 2 }}
{{- end }}
volumes:
{{ include "rankwatch.jobVolumes" . }}
{{- end }}
