{{- /*
kvguard.ruleGroups: the groups of one rule template from dashboards/rules.py, filled from
.Values.prometheusRule, as YAML. Called with (dict "root" $ "path" "files/<name>.template.yaml").
The generator writes files/*.template.yaml: its rule table with the config's placeholders kept. This
fills them as the generator fills them from its DEFAULTS (which values.yaml mirrors):
  ${jobSelector}           prometheusRule.jobSelector
  ${thresholds.NAME}       prometheusRule.thresholds.NAME, integral values written without a fraction
  ${deviceJoins.NAME}      prometheusRule.deviceJoins.NAME (the exporters' selectors)
  ${for}                   prometheusRule.for.<the alert's name>
  ${runbookUrl}            printf prometheusRule.runbookUrl <the alert's name in lower case>; empty (the
                           default): the release's runbook pages (templates/runbook.yaml,
                           http://<fullname>-runbook.<namespace>.svc/<alert>.html); with runbook.enabled
                           false, the runbook the release's own Service serves,
                           <scheme>://<fullname>.<namespace>.svc:<kvguard.port>/runbook/%s, or where the
                           release has no Service (mode cluster, service.enabled false) the template
                           file's runbookUrl (dashboards/rules.py's RUNBOOK_URL: #<alert> on the page the
                           external label kvguard_runbook_url names, else the alert's instance's /runbook)
then tidies what an empty selector leaves in an expr, as rules.py's tidy(): `,}` to `}`, `name{}` to
`name`. Substitution happens in the parsed strings, so a value's quotes cannot break the YAML.
Alerts named in prometheusRule.disabled (true) are left out; prometheusRule.customRules.<alert>.severity
replaces an alert's severity, and prometheusRule.additionalRuleLabels are added to every alert's labels,
as rules.py's kept() and filled() do.
*/}}
{{- define "kvguard.ruleGroups" -}}
{{- $config := .root.Values.prometheusRule }}
{{- $path := .path }}
{{- $text := .root.Files.Get $path }}
{{- if not $text }}
{{- fail (printf "%s is missing or empty (run python dashboards/rules.py); set prometheusRule.enabled=false to render without rules" $path) }}
{{- end }}
{{- $parsed := fromYaml $text }}
{{- if hasKey $parsed "Error" }}
{{- fail (printf "%s: %s" $path (get $parsed "Error")) }}
{{- end }}
{{- $runbookUrl := toString (default "" $config.runbookUrl) }}
{{- if not $runbookUrl }}
{{- if include "kvguard.runbookEnabled" .root }}
{{- $runbookUrl = include "kvguard.runbookUrl" .root }}
{{- else if include "kvguard.serviceEnabled" .root }}
{{- $runbookUrl = printf "%s://%s.%s.svc:%v/runbook/%%s" (include "kvguard.scheme" .root) (include "kvguard.fullname" .root) .root.Release.Namespace .root.Values.kvguard.port }}
{{- else }}
{{- $runbookUrl = toString (get $parsed "runbookUrl") }}
{{- end }}
{{- end }}
{{- $common := dict "${jobSelector}" (toString $config.jobSelector) }}
{{- range $token, $written := fromYaml (include "kvguard.thresholdTokens" .root) }}
{{- $_ := set $common $token (toString $written) }}
{{- end }}
{{- range $name, $value := omit $config.deviceJoins "enabled" }}
{{- $_ := set $common (printf "${deviceJoins.%s}" $name) (toString $value) }}
{{- end }}
{{- $groups := list }}
{{- range $group := get $parsed "groups" }}
{{- $rules := list }}
{{- range $rule := $group.rules }}
{{- if not (and (hasKey $rule "alert") (index (default (dict) $config.disabled) $rule.alert)) }}
{{- $values := deepCopy $common }}
{{- if hasKey $rule "alert" }}
{{- $_ := set $values "${runbookUrl}" (printf $runbookUrl (lower $rule.alert)) }}
{{- if hasKey $rule "for" }}
{{- if not (hasKey $config.for $rule.alert) }}
{{- fail (printf "prometheusRule.for.%s is missing" $rule.alert) }}
{{- end }}
{{- $_ := set $values "${for}" (index $config.for $rule.alert) }}
{{- end }}
{{- end }}
{{- $filled := dict }}
{{- range $key, $field := $rule }}
{{- if kindIs "map" $field }}
{{- $map := dict }}
{{- range $k, $v := $field }}
{{- $s := toString $v }}
{{- range $token, $value := $values }}{{ $s = replace $token $value $s }}{{ end }}
{{- $_ := set $map $k $s }}
{{- end }}
{{- $_ := set $filled $key $map }}
{{- else }}
{{- $s := toString $field }}
{{- range $token, $value := $values }}{{ $s = replace $token $value $s }}{{ end }}
{{- if eq $key "expr" }}
{{- $s = regexReplaceAll "([A-Za-z0-9_:])\\{\\}" (regexReplaceAll ",\\}" $s "}") "${1}" }}
{{- end }}
{{- $_ := set $filled $key $s }}
{{- end }}
{{- end }}
{{- if hasKey $rule "alert" }}
{{- $labels := get $filled "labels" }}
{{- with (index (default (dict) $config.customRules) $rule.alert) }}
{{- with .severity }}{{ $_ := set $labels "severity" . }}{{ end }}
{{- end }}
{{- range $name, $value := (default (dict) $config.additionalRuleLabels) }}
{{- $_ := set $labels $name (toString $value) }}
{{- end }}
{{- end }}
{{- $rules = append $rules $filled }}
{{- end }}
{{- end }}
{{- $groups = append $groups (dict "name" $group.name "rules" $rules) }}
{{- end }}
{{- if contains "${" (toYaml $groups) }}
{{- fail (printf "%s holds a placeholder this template does not fill: %s" $path (regexFind "\\$\\{[^}]*\\}" (toYaml $groups))) }}
{{- end }}
{{- toYaml $groups }}
{{- end }}

{{- /*
kvguard.prometheusRule: a PrometheusRule named <fullname><suffix> holding kvguard.ruleGroups of path.
Called with (dict "root" $ "suffix" "" "path" "files/<name>.template.yaml").
*/}}
{{- define "kvguard.prometheusRule" -}}
apiVersion: monitoring.coreos.com/v1
kind: PrometheusRule
metadata:
  name: {{ include "kvguard.fullname" .root }}{{ .suffix }}
  namespace: {{ .root.Release.Namespace }}
  labels:
    {{- include "kvguard.labels" .root | nindent 4 }}
    {{- with .root.Values.prometheusRule.labels }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
spec:
  groups:
    {{- include "kvguard.ruleGroups" (dict "root" .root "path" .path) | nindent 4 }}
{{- end }}

{{- /*
kvguard.thresholdTokens: "${thresholds.NAME}" -> the number as the rules write it (integral values without a
fraction, as dashboards/rules.py's number()), as YAML; the rules and the runbook pages fill the same way.
*/}}
{{- define "kvguard.thresholdTokens" -}}
{{- $tokens := dict }}
{{- range $name, $value := .Values.prometheusRule.thresholds }}
{{- $number := float64 $value }}
{{- $written := toString $number }}
{{- if and (lt $number 1e15) (gt $number -1e15) (eq $number (float64 (int64 $number))) }}
{{- $written = toString (int64 $number) }}
{{- end }}
{{- $_ := set $tokens (printf "${thresholds.%s}" $name) $written }}
{{- end }}
{{- toYaml $tokens }}
{{- end }}
