"""The committed output, local or on an object store: where it lives, its manifest and
committed parts, the one commit protocol and its summary.

- A backend is one folder (`local/`, `objectstore/`) implementing `backend.Backend`; a
  new one is a folder beside them and one line in `protocol.BACKENDS`.
- The manifest's format and `SCHEMA_VERSION` are `manifestformat`'s (a format bump
  starts there); reading a committed output's manifest and parts is `manifest`'s.
- What retirement may drop from a committed output, and its marker, are `retiring`'s;
  the drops are `raycap.runs.retirement`'s.

Imports: `raycap.observe`, `raycap.capture`, `raycap.rows`.
"""

# Checked by tests/test_layout.py: the raycap packages this one imports at module level,
# and those it may reach only inside a function (a call that needs them).
MAY_IMPORT = ("raycap.capture", "raycap.rows", "raycap.observe")
MAY_CALL_LAZILY = ()
