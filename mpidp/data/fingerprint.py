"""What identifies a dataset's contents, from its files' metadata (no MPI), recorded with a
run so that a resume can tell whether its data changed; the ranks add the CRC-32 of files
without checksums of their own (:func:`mpidp.data.distribute.data_fingerprint`)."""

from __future__ import annotations

import os
import zipfile

from .sources import BUILTIN, not_regular

__all__ = ["fingerprint_change", "metadata_fingerprint"]


def metadata_fingerprint(spec: str) -> dict:
    """What identifies dataset ``spec`` (JSON-able): a built-in's name (its parameters are in
    the configuration); a file's (or a folder's ``X.npy`` and ``y.npy``) size, and for a zip
    (``.npz``) each member's size and CRC-32 from its directory. ValueError naming a file
    that cannot be read."""
    if spec in BUILTIN:
        return {"builtin": spec}
    paths = [os.path.join(spec, n) for n in ("X.npy", "y.npy")] if os.path.isdir(spec) else [spec]
    return {"files": [_file_fingerprint(p) for p in paths]}


def _file_fingerprint(path: str) -> dict:
    if os.path.exists(path) and not os.path.isfile(path):
        raise not_regular(path)  # a FIFO or a device would be read without end
    try:
        out: dict = {"name": os.path.basename(path), "size": os.path.getsize(path)}
        if zipfile.is_zipfile(path):  # the members' CRCs cover every byte, timestamps aside
            with zipfile.ZipFile(path) as z:
                out["crc"] = {i.filename: [i.file_size, i.CRC] for i in z.infolist()}
    except (OSError, zipfile.BadZipFile) as exc:
        raise ValueError(f"cannot fingerprint dataset file {path}: {exc}") from exc
    return out


def fingerprint_change(was: dict, now: dict) -> str:
    """How fingerprint ``now`` differs from ``was``, in a few words (for a refusal)."""
    if "builtin" in was or "builtin" in now:
        return f"{was.get('builtin', 'files')} -> {now.get('builtin', 'files')}"
    for a, b in zip(was.get("files", []), now.get("files", [])):
        if a["size"] != b["size"]:
            return f"{b['name']} was {a['size']} bytes, now {b['size']}"
        if a != b:
            return f"{b['name']} has the same size but different contents"
    return "its files differ"
