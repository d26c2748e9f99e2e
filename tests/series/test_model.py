"""The patch model: a patch mail's subject, trailers and paths; the apply marker."""

from __future__ import annotations

import json

import pytest

from vllm_hs.errors import VllmHsError
from vllm_hs.series.model import Marker, PatchDigest, PatchMail

MAIL = """\
From 0000000000000000000000000000000000000000 Mon Sep 17 00:00:00 2001
From: A Maintainer
 <maintainer@example.invalid>
Date: Mon, 30 Nov 2026 01:56:31 +0000
Subject: [PATCH] [Core] A subject long enough that git format-patch folds
 it onto a second line

Why the change is needed. This line is no trailer: Upstream-Status: Accepted.

Signed-off-by: A Maintainer <maintainer@example.invalid>
Upstream-PR: separate
Upstream-Status: Pending
vLLM-Version: 0.32.0
---
 vllm/a.py   | 2 +-
 vllm/b.py   | 1 -
 vllm/new.py | 1 +
 3 files changed, 2 insertions(+), 2 deletions(-)
 delete mode 100644 vllm/b.py
 create mode 100644 vllm/new.py

diff --git a/vllm/a.py b/vllm/a.py
index 111111111111..222222222222 100644
--- a/vllm/a.py
+++ b/vllm/a.py
@@ -1 +1 @@
-A = 1
+A = 2
diff --git a/vllm/b.py b/vllm/b.py
deleted file mode 100644
index 333333333333..000000000000
--- a/vllm/b.py
+++ /dev/null
@@ -1 +0,0 @@
-B = 1
diff --git a/vllm/new.py b/vllm/new.py
new file mode 100644
index 000000000000..444444444444
--- /dev/null
+++ b/vllm/new.py
@@ -0,0 +1 @@
+NEW = 1
-- 
2.43.0

"""  # noqa: W291 (format-patch's signature separator is "-- ")


def test_patch_mail_subject_trailers_and_paths() -> None:
    mail = PatchMail.parse(MAIL)
    assert mail.subject == (
        "[Core] A subject long enough that git format-patch folds it onto a second line"
    )
    assert mail.headers == {
        "Signed-off-by": "A Maintainer <maintainer@example.invalid>",
        "Upstream-PR": "separate",
        "Upstream-Status": "Pending",
        "vLLM-Version": "0.32.0",
    }
    assert mail.message.startswith("Why the change is needed.")
    assert mail.touched_paths() == [
        "vllm/a.py",
        "vllm/a.py",
        "vllm/b.py",
        "vllm/new.py",
    ]


def test_fields_outside_the_trailer_block_are_not_headers() -> None:
    text = MAIL.replace(
        "\nSigned-off-by:", "\nUpstream-Status: Accepted\n\nSigned-off-by:"
    )
    text = text.replace("Upstream-Status: Pending\n", "")
    assert "Upstream-Status" not in PatchMail.parse(text).headers


def test_a_mail_without_a_patch_subject() -> None:
    assert PatchMail.parse(MAIL.replace("[PATCH] ", "")).subject is None


def test_marker_json_is_the_released_format() -> None:
    marker = Marker(
        series="v0.32.0",
        revision=4,
        vllm_hs_version="0.1.0",
        patches=(PatchDigest("0001-a.patch", "ab" * 32),),
        files={"vllm/a.py": "cd" * 32},
    )
    released = {
        "series": "v0.32.0",
        "revision": 4,
        "vllm_hs_version": "0.1.0",
        "patches": [{"name": "0001-a.patch", "sha256": "ab" * 32}],
        "files": {"vllm/a.py": "cd" * 32},
    }
    assert marker.dumps() == json.dumps(released, indent=2) + "\n"
    assert Marker.loads(marker.dumps(), "marker") == marker


@pytest.mark.parametrize("text", ["[]", "{", '{"series": "v0.32.0"}'])
def test_a_broken_marker_is_one_clear_error(text: str) -> None:
    with pytest.raises(VllmHsError, match="vllm/_vllm_hs.json"):
        Marker.loads(text, "vllm/_vllm_hs.json")
