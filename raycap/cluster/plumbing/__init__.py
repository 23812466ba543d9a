"""Ray plumbing: joining a cluster (`connect`), its console output (`console`), what a Ray
failure means (`failures`), which node serves each capture directory (`placement`) and
the builder task (`task`).

Imports: Ray, and raycap's packages below `raycap.cluster`; nothing else of `raycap.cluster`.
"""
