-- Run once by the postgres image on an empty data volume: one database per server.
CREATE DATABASE mlflow;
CREATE DATABASE prefect;
