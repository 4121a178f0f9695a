"""The operator's features around the request path: reload and shutdown, `/metrics`, the live status
page, the LoRA profile and the watch that keeps it resolved.
"""
