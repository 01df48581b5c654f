-- A second database on the same server for the MLflow tracking store (Prefect uses "prefect").
CREATE DATABASE mlflow OWNER grpo;
