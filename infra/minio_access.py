"""MinIO's users, policies and buckets for the team stack (compose's minio-init runs it once).

One user per service, each allowed into its own bucket only:
  mlflow -> the MLflow server's artifact bucket (MLFLOW_BUCKET); clients never see S3 credentials,
            the server proxies their uploads (--serve-artifacts);
  worker -> the DVC remote's bucket (DVC_BUCKET), pushed and pulled by the flow.
Laptops get users of their own (`add-laptop NAME`, policy `laptop-dvc`): they read the DVC
bucket, add objects to the remote's content-addressed `files/` (their `dvc push` of data), and
write freely only under `laptops/<their name>/`; never the run-cache (`<prefix>/runs/`), never a
delete. The worker trusts no run-cache it pulls and hashes every object it pulls again
(flows/remote.py), so a laptop's rewrite of an object is refused, not used.
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


def laptop_policy(bucket: str, prefix: str = "cache") -> dict:
    """A laptop's key: read `bucket`; add objects under `<prefix>/files/` (DVC's content-addressed
    store, which the worker verifies as it pulls) and anything under `laptops/<user>/`; no delete
    outside that, no run-cache (`<prefix>/runs/`)."""
    own = f"arn:aws:s3:::{bucket}/laptops/${{aws:username}}/*"
    upload = ["s3:PutObject", "s3:AbortMultipartUpload", "s3:ListMultipartUploadParts"]
    return {
        "Version": "2012-10-17",
        "Statement": [
            {"Effect": "Allow", "Action": ["s3:GetBucketLocation", "s3:ListBucket"],
             "Resource": [f"arn:aws:s3:::{bucket}"]},
            {"Effect": "Allow", "Action": ["s3:GetObject"], "Resource": [f"arn:aws:s3:::{bucket}/*"]},
            {"Effect": "Allow", "Action": upload,
             "Resource": [f"arn:aws:s3:::{bucket}/{prefix}/files/*"]},
            {"Effect": "Allow", "Action": [*upload, "s3:DeleteObject"], "Resource": [own]},
        ],
    }


def services(env: dict[str, str]) -> dict[str, tuple[str, str]]:
    """user -> (its bucket, the name of the variable holding its secret key)."""
    return {"mlflow": (env.get("MLFLOW_BUCKET") or "mlflow", "MLFLOW_S3_SECRET"),
            "worker": (env.get("DVC_BUCKET") or "dvc", "WORKER_S3_SECRET")}


def _clients(env: dict[str, str]):
    from minio import Minio, MinioAdmin
    from minio.credentials import StaticProvider

    endpoint = env.get("MINIO_ENDPOINT", "minio:9000")
    root = StaticProvider(env["MINIO_ROOT_USER"], env["MINIO_ROOT_PASSWORD"])
    return (Minio(endpoint, credentials=root, secure=False),
            MinioAdmin(endpoint=endpoint, credentials=root, secure=False))


def _attach(admin, policy: str, user: str) -> None:
    try:
        admin.attach_policy([policy], user=user)
    except Exception as err:  # already attached: MinIO answers with an error
        if "already" not in str(err).lower():
            raise


def add_laptop(name: str) -> None:
    """A laptop's user with policy `laptop-dvc`; its secret key read from stdin (never argv)."""
    import sys

    secret = sys.stdin.readline().strip()
    if len(secret) < 12:
        sys.exit(f"error: the secret key for '{name}' (read from stdin) must have 12 characters "
                 "or more: printf '%s\\n' \"$SECRET\" | python infra/minio_access.py add-laptop NAME")
    _, admin = _clients(dict(os.environ))
    admin.user_add(name, secret)
    _attach(admin, "laptop-dvc", name)
    print(f"user '{name}': reads the DVC bucket, adds DVC objects, writes laptops/{name}/ only")


def main() -> None:
    from minio.commonconfig import ENABLED
    from minio.versioningconfig import VersioningConfig

    env = dict(os.environ)
    s3, admin = _clients(env)
    for user, (bucket, secret_var) in services(env).items():
        if not s3.bucket_exists(bucket):
            s3.make_bucket(bucket)
        s3.set_bucket_versioning(bucket, VersioningConfig(ENABLED))
        admin.user_add(user, env[secret_var])
        admin.policy_add(f"{user}-bucket", policy=bucket_policy(bucket))
        _attach(admin, f"{user}-bucket", user)
        print(f"user '{user}': read and write in bucket '{bucket}' only (versioned)")
    dvc_bucket = services(env)["worker"][0]
    admin.policy_add("laptop-dvc", policy=laptop_policy(dvc_bucket, env.get("DVC_PREFIX") or "cache"))
    print("policy 'laptop-dvc' for laptops' users (add-laptop NAME)")


if __name__ == "__main__":
    import sys

    if sys.argv[1:2] == ["add-laptop"] and len(sys.argv) == 3:
        add_laptop(sys.argv[2])
    elif len(sys.argv) == 1:
        main()
    else:
        sys.exit("usage: minio_access.py             (buckets, service users, policies)\n"
                 "       minio_access.py add-laptop NAME   (secret key on stdin)")
