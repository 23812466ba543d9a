"""NeMo Gym's token-capture modules, name for name, and the capture directory they share.

Owns: entries (`records`), the store, builders, the single-rollout consumer, protocols,
config, the request-scoped sink and record delivery; the directory's files, their safe
opening, and the stream's markers and record files kept beside a capture; the mask
reasons, every name and which layer adds it (`maskreasons`: a new reason starts there).
Imports: nothing of raycap outside this package but `raycap.errors`; no Ray, no pyarrow,
so a model server imports it alone.
"""

# Checked by tests/test_layout.py: the raycap packages this one imports at module level,
# and those it may reach only inside a function (a call that needs them).
MAY_IMPORT = ()
MAY_CALL_LAZILY = ()
