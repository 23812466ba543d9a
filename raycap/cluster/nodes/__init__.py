"""The node actors, and what they run on their nodes.

`actor` is the actor that serves a node's capture directories; `fleet` is the driver's
hold on them (placement done, actors started). `node_build` and `node_stream` run in a
node's actor, on its node: a step's builds of the ids it holds, and its side of a
stream over `NODE:/path` directories.

Imports: `raycap.cluster.plumbing`.
"""
