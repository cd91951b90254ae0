#!/bin/sh
# Refuses to start the team stack while a secret is unset, still env.example's placeholder
# (change-me...), or shorter than 12 characters. compose runs it before every other service;
# arguments are the names of the variables to check (never their values).
#   sh infra/preflight.sh POSTGRES_PASSWORD MLFLOW_DB_PASSWORD ...
set -u
status=0
for name in "$@"; do
  eval "value=\${$name-}"
  case "$value" in
    "") reason="is not set" ;;
    change-me*) reason="is still env.example's placeholder" ;;
    *) if [ "${#value}" -lt 12 ]; then reason="is shorter than 12 characters"; else continue; fi ;;
  esac
  echo "error: $name $reason: set a real secret for it in infra/.env (e.g. openssl rand -base64 24)" >&2
  status=1
done
[ "$status" -eq 0 ] && echo "preflight: the $# secrets are set"
exit "$status"
