#!/bin/sh
# One role and one database per server, each role owning only its own: run once by the postgres
# image on an empty data volume (/docker-entrypoint-initdb.d), and by tests/infra against the
# cluster they start. The passwords come from the environment (psql's \getenv) and are quoted by
# psql (:'...'): never on a command line, never pasted into SQL text.
#   mlflow  -> databases mlflow (runs, registry) and mlflow_auth (users and permissions)
#   prefect -> database prefect
set -eu
psql -v ON_ERROR_STOP=1 -q --username "$POSTGRES_USER" --dbname postgres <<'SQL'
\getenv mlflow_password MLFLOW_DB_PASSWORD
\getenv prefect_password PREFECT_DB_PASSWORD
CREATE ROLE mlflow LOGIN PASSWORD :'mlflow_password';
CREATE ROLE prefect LOGIN PASSWORD :'prefect_password';
CREATE DATABASE mlflow OWNER mlflow;
CREATE DATABASE mlflow_auth OWNER mlflow;
CREATE DATABASE prefect OWNER prefect;
REVOKE ALL ON DATABASE mlflow, mlflow_auth, prefect FROM PUBLIC;
SQL
