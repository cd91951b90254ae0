"""The confined child that parses one untrusted clip: `python -m tasks.ingest.clip_child`.

FFmpeg's demuxers and decoders are C code reading attacker-shaped bytes, so they never run in the
stage's processes. The parent (tasks/ingest/clips.py) hands this process the clip as an open file
descriptor (a regular file it has checked and hashed), a request on stdin, and a wall-clock
deadline it enforces by killing the process group. Before FFmpeg is loaded, this process caps its
own address space (RLIMIT_AS, `decode_memory_mb`) and CPU time (RLIMIT_CPU), so no file can make it
take the machine's memory or spin for ever. It writes the samples as PNGs into the folder the
request names and prints one JSON line: `{"info": {...}}` or `{"reject": reason, "detail": ...}`.
"""
from __future__ import annotations

import json
import math
import os
import resource
import sys
from pathlib import Path


def confine(memory_mb: int, seconds: float) -> None:
    """Cap this process's address space and CPU time (hard limits: they cannot be raised again)."""
    memory = memory_mb * 1024 * 1024
    resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    cpu = math.ceil(seconds) + 1
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def main() -> int:
    request = json.loads(sys.stdin.readline())
    spec_json = request["spec"]
    confine(spec_json["decode_memory_mb"], spec_json["decode_seconds"])
    from tasks.ingest.checks import Reject  # imported under the limits, with FFmpeg
    from tasks.ingest.video import ClipSpec, sample_clip

    try:
        with os.fdopen(request["fd"], "rb") as fh:
            info = sample_clip(fh, ClipSpec.from_json(spec_json), Path(request["out"]))
    except Reject as err:
        answer: dict = {"reject": err.reason, "detail": err.detail}
    except MemoryError:
        answer = {"reject": "decode_limit", "detail": f"the decoder needed more than ingest.video.decode_memory_mb "
                                                      f"{spec_json['decode_memory_mb']} MiB"}
    else:
        answer = {"info": info}
    print(json.dumps(answer), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
