"""MinIO's users, policies and buckets for the team stack (compose's minio-init runs it once).

One user per service, each allowed into its own bucket only:
  mlflow -> the MLflow server's artifact bucket (MLFLOW_BUCKET); clients never see S3 credentials,
            the server proxies their uploads (--serve-artifacts);
  worker -> the DVC remote's bucket (DVC_BUCKET), pushed and pulled by the flow.
Versioning is on in both buckets, so a deleted or overwritten object can be restored
(`mc undo`, `mc cp --version-id`). Secrets come from the environment (MINIO_ROOT_PASSWORD,
MLFLOW_S3_SECRET, WORKER_S3_SECRET) through MinIO's Python SDK: never on a command line.
Running it again changes nothing that exists but the policies, which it rewrites.
"""
from __future__ import annotations

import os


def bucket_policy(bucket: str) -> dict:
    """Read, write, list and delete in `bucket`, nothing anywhere else."""
    return {
        "Version": "2012-10-17",
        "Statement": [
            {"Effect": "Allow", "Action": ["s3:GetBucketLocation", "s3:ListBucket",
                                           "s3:ListBucketMultipartUploads",
                                           "s3:ListBucketVersions"],
             "Resource": [f"arn:aws:s3:::{bucket}"]},
            {"Effect": "Allow", "Action": ["s3:GetObject", "s3:PutObject", "s3:DeleteObject",
                                           "s3:AbortMultipartUpload",
                                           "s3:ListMultipartUploadParts"],
             "Resource": [f"arn:aws:s3:::{bucket}/*"]},
        ],
    }


def services(env: dict[str, str]) -> dict[str, tuple[str, str]]:
    """user -> (its bucket, the name of the variable holding its secret key)."""
    return {"mlflow": (env.get("MLFLOW_BUCKET") or "mlflow", "MLFLOW_S3_SECRET"),
            "worker": (env.get("DVC_BUCKET") or "dvc", "WORKER_S3_SECRET")}


def main() -> None:
    from minio import Minio, MinioAdmin
    from minio.commonconfig import ENABLED
    from minio.credentials import StaticProvider
    from minio.versioningconfig import VersioningConfig

    env = dict(os.environ)
    endpoint = env.get("MINIO_ENDPOINT", "minio:9000")
    root = StaticProvider(env["MINIO_ROOT_USER"], env["MINIO_ROOT_PASSWORD"])
    s3 = Minio(endpoint, credentials=root, secure=False)
    admin = MinioAdmin(endpoint=endpoint, credentials=root, secure=False)
    for user, (bucket, secret_var) in services(env).items():
        if not s3.bucket_exists(bucket):
            s3.make_bucket(bucket)
        s3.set_bucket_versioning(bucket, VersioningConfig(ENABLED))
        admin.user_add(user, env[secret_var])
        admin.policy_add(f"{user}-bucket", policy=bucket_policy(bucket))
        try:
            admin.attach_policy([f"{user}-bucket"], user=user)
        except Exception as err:  # already attached: MinIO answers with an error
            if "already" not in str(err).lower():
                raise
        print(f"user '{user}': read and write in bucket '{bucket}' only (versioned)")


if __name__ == "__main__":
    main()
