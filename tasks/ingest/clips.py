"""A clip's work in an ingest worker: the file checks, the hash, and the confined child that decodes it.

A clip file is checked as every input is before it is opened (inside the root, a regular file: a
FIFO named `x.mp4` is refused by `stat`, unopened), then against `max_bytes` by its size, then
opened non-blocking, checked again on its descriptor and hashed (SHA-256, at most max_bytes read).
The parsing happens in a child process (tasks/ingest/clip_child.py) bounded in memory and CPU
time, which the worker kills when it passes `decode_seconds` of wall-clock time.

A folder of frames is read here, as images are: every frame a regular file inside the root, the
sampled ones decoded with the images' checks (`max_pixels` from the header), all of one size.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

from tasks.ingest import clip_child
from tasks.ingest.checks import Limits, Reject, decode, inside_root, open_regular, read_bytes
from tasks.ingest.video import ClipSpec, bucket_size, check_size, fit_to_bucket, frame_count, write_frames

CHUNK = 1024 * 1024
WORK = ".clips-work"  # inside the output being built: each clip's samples before the judge keeps them


def run_clip(root: Path, path: Path, frames: tuple[str, ...], frames_fps: float, spec: ClipSpec,
             work_dir: Path) -> tuple[str, dict[str, Any]]:
    """(sha256, the clip's facts with `work`: the folder holding its samples) or Reject."""
    out = work_dir / uuid.uuid4().hex
    try:
        if frames:
            return _frame_folder(root, path, frames, frames_fps, spec, out)
        return _clip_file(root, path, spec, out)
    except Reject:
        shutil.rmtree(out, ignore_errors=True)
        raise


def _clip_file(root: Path, path: Path, spec: ClipSpec, out: Path) -> tuple[str, dict[str, Any]]:
    target = inside_root(root, path)
    fd = open_regular(target, spec.max_bytes)
    try:
        sha = _hash(fd, spec.max_bytes)
        os.lseek(fd, 0, os.SEEK_SET)
        answer = _run_child(fd, spec, out)
    finally:
        os.close(fd)
    if "reject" in answer:
        raise Reject(answer["reject"], answer["detail"])
    return sha, {**answer["info"], "work": str(out)}


def _hash(fd: int, max_bytes: int) -> str:
    digest, seen = hashlib.sha256(), 0
    while chunk := os.read(fd, CHUNK):
        seen += len(chunk)
        if seen > max_bytes:
            raise Reject("oversized_file", f"grew past ingest.video.max_bytes {max_bytes:,} while read")
        digest.update(chunk)
    return digest.hexdigest()


def _run_child(fd: int, spec: ClipSpec, out: Path) -> dict[str, Any]:
    """The child's answer; a child past decode_seconds is killed (with its group), one that dies is reported."""
    request = json.dumps({"fd": fd, "out": str(out), "spec": spec.to_json()}) + "\n"
    proc = subprocess.Popen(
        [sys.executable, "-m", clip_child.__name__], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, pass_fds=(fd,), start_new_session=True, text=True,
    )
    try:
        stdout, stderr = proc.communicate(request, timeout=spec.decode_seconds)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # the child and anything it started
        except ProcessLookupError:  # it ended just now
            pass
        proc.communicate()
        raise Reject("decode_limit", f"still checking or decoding after ingest.video.decode_seconds "
                                     f"{spec.decode_seconds:g} s: killed") from None
    lines = stdout.strip().splitlines()
    if proc.returncode == 0 and lines:
        return json.loads(lines[-1])
    if proc.returncode == -signal.SIGXCPU or proc.returncode == -signal.SIGKILL:
        raise Reject("decode_limit", f"the decoder passed its CPU time bound (ingest.video.decode_seconds "
                                     f"{spec.decode_seconds:g} s): killed")
    why = (stderr.strip().splitlines() or ["no message"])[-1][:300]
    if "MemoryError" in stderr or "alloc" in stderr.lower():
        raise Reject("decode_limit", f"the decoder passed ingest.video.decode_memory_mb "
                                     f"{spec.decode_memory_mb} MiB: {why}")
    raise Reject("corrupt", f"the decoder failed (exit {proc.returncode}): {why}")


def _frame_folder(root: Path, folder: Path, frames: tuple[str, ...], frames_fps: float, spec: ClipSpec,
                  out: Path) -> tuple[str, dict[str, Any]]:
    """A folder of frames (name order, shot at frames_fps): hashed whole, sampled like a clip file."""
    if len(frames) > spec.max_seconds * frames_fps + 1:
        raise Reject("too_long", f"{len(frames)} frames at frames_fps {frames_fps:g} is over "
                                 f"ingest.video.max_seconds {spec.max_seconds:g}")
    digest, total = hashlib.sha256(), 0
    for frame in frames:  # the identity of the clip: every frame's name and bytes
        data = read_bytes(root, Path(frame), spec.max_bytes)
        total += len(data)
        if total > spec.max_bytes:
            raise Reject("oversized_file", f"its frames pass ingest.video.max_bytes {spec.max_bytes:,}")
        digest.update(Path(frame).name.encode() + b"\0" + hashlib.sha256(data).digest())
    span = (len(frames) - 1) / frames_fps
    count = frame_count(span, spec)
    picks = [min(len(frames) - 1, round(i * frames_fps / spec.fps)) for i in range(count)]
    limits = Limits(spec.min_side, spec.max_pixels, spec.max_aspect_ratio)
    size, first, samples = None, None, []
    for i in picks:
        image, stored = decode(read_bytes(root, Path(frames[i])), limits)
        if first is None:
            first = stored
            check_size(*stored, spec)
            size = bucket_size(*stored, spec)
        elif stored != first:
            raise Reject("corrupt", f"frame {Path(frames[i]).name} is {stored[0]}x{stored[1]}, the first "
                                    f"{first[0]}x{first[1]}: a clip's frames are all one size")
        samples.append(fit_to_bucket(image.convert("RGB"), size))
    write_frames(samples, out)
    assert size is not None and first is not None
    info = {"codec": "frames", "container": "folder", "source_width": first[0], "source_height": first[1],
            "source_fps": frames_fps, "source_frames": len(frames),
            "source_seconds": round(len(frames) / frames_fps, 3),
            "width": size[0], "height": size[1], "frames": count, "fps": spec.fps}
    return digest.hexdigest(), {**info, "work": str(out)}

