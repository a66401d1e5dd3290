"""The gRPC layer: services, streams, shared-memory segments and background tasks.

It validates, translates and forwards; the decisions are the core's.
"""
