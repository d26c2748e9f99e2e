"""The patch series and the commands that maintain and use it.

`model` reads a series (patches/v<X>/: the series file, the patch mails, the
apply marker); `git` is the one git wrapper. Commands: `apply` (a series onto a
tree), `status` (is the installed vLLM patched), `wheel` (a patched vLLM wheel),
`stage` / `refresh` (the series as a git branch on vLLM's sdist, and back),
`lint` (headers, clean apply, vLLM's ruff), `upstream_tests` (vLLM's own unit
tests, unpatched against patched). `sdist` fetches vLLM's source release;
`upstream_shim` is a pytest plugin copied into upstream test runs.
"""
