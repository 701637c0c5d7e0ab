"""``--tensorboard-logdir`` with the diagnostics criterion: the per-layer statistics arrive in
TensorBoard's event files as scalars, and fairseq no longer asks for tensorboardX.

fairseq 0.12 writes through ``torch.utils.tensorboard`` (which needs the large ``tensorboard``
package) or, failing that, ``tensorboardX``; its text-to-speech task imports tensorboardX on every
command and logs "Please install tensorboardX" without it. The pinned stack (requirements/lock.txt)
therefore carries tensorboardX. The events are read back here with tensorboardX's own protobuf
classes and record checksum, so the test needs nothing beyond that pinned stack.
"""

from __future__ import annotations

import math
import struct
from pathlib import Path

from conftest import TINY_DIMS, USER_DIR, run_cli


def read_events(path: Path) -> list:
    """Every ``Event`` of a TFRecord event file (length, masked CRC of the length, payload, masked
    CRC of the payload), checksums verified: a torn or corrupt file fails here, not silently."""
    from tensorboardX.proto.event_pb2 import Event
    from tensorboardX.record_writer import masked_crc32c

    events = []
    data = path.read_bytes()
    pos = 0
    while pos < len(data):
        header = data[pos : pos + 8]
        (length,) = struct.unpack("Q", header)
        (header_crc,) = struct.unpack("I", data[pos + 8 : pos + 12])
        assert header_crc == masked_crc32c(header), f"{path}: bad length checksum at byte {pos}"
        payload = data[pos + 12 : pos + 12 + length]
        (payload_crc,) = struct.unpack("I", data[pos + 12 + length : pos + 16 + length])
        assert payload_crc == masked_crc32c(payload), f"{path}: bad record checksum at byte {pos}"
        events.append(Event.FromString(payload))
        pos += 16 + length
    return events


def scalars(logdir: Path) -> dict:
    """``{run: {tag: [(step, value), ...]}}`` of every event file under ``logdir`` (one run per
    sub-folder, as fairseq writes them: ``train_inner``, ``train``, ``valid``)."""
    out: dict = {}
    for path in sorted(logdir.rglob("events.out.tfevents.*")):
        run = path.parent.relative_to(logdir).as_posix()
        for event in read_events(path):
            for value in event.summary.value:
                if value.HasField("simple_value"):
                    out.setdefault(run, {}).setdefault(value.tag, []).append((event.step, value.simple_value))
    return out


def test_diagnostics_reach_tensorboard_as_scalars(synthetic_bin, tmp_path):
    logdir = tmp_path / "tb"
    proc = run_cli(
        "train", synthetic_bin, "--user-dir", USER_DIR, "--arch", "twt_iwslt_de_en", *TINY_DIMS,
        "--criterion", "label_smoothed_cross_entropy_diagnostics", "--label-smoothing", "0.1",
        "--diagnostics-interval", "1", "--optimizer", "adam", "--lr", "1e-3", "--max-tokens", "500",
        "--max-update", "3", "--log-interval", "1", "--log-format", "simple", "--disable-validation",
        "--no-save", "--seed", "3", "--tensorboard-logdir", logdir,
    )  # fmt: skip
    assert "Please install tensorboardX" not in proc.stdout
    assert "tensorboard not found" not in proc.stdout  # fairseq's warning when no writer imports

    runs = scalars(logdir)
    assert "train_inner" in runs, f"no per-update scalars under {logdir}: {sorted(runs)}"
    inner = runs["train_inner"]
    for tag in (
        "diag_var/encoder.layers.0.self_attn",
        "diag_var/decoder.layers.1.encoder_attn",
        "diag_norm_in/encoder.layers.0.self_attn_layer_norm",
        "diag_scalenorm_g/encoder.layers.1.final_layer_norm",
        "diag_gnorm/encoder.layers.0",
        "diag_gnorm/decoder.layers.1",
        "loss",
    ):
        assert tag in inner, f"{tag} missing; diag tags: {sorted(t for t in inner if t.startswith('diag_'))[:8]}"
        points = inner[tag]
        assert [step for step, _ in points] == [1, 2, 3], (tag, points)  # --diagnostics-interval 1
        assert all(math.isfinite(v) for _, v in points), (tag, points)
    assert all(v > 0 for _, v in inner["diag_gnorm/encoder.layers.0"])
    # every statistic the criterion logs for this model, not only the ones named above
    assert sum(t.startswith("diag_") for t in inner) >= 40
