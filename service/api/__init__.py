"""The HTTP edge: routes, their dependencies, bodies, schemas, and the execute lane.

Routes are thin: they parse a request, call one entry of the domain
(``service.calls``) or of the replicas (``service.cluster``), and shape the
answer. Nothing here runs a program or holds state of its own.
"""
