"""deployments: the Ray Serve application built on bcg."""
__all__: list[str] = []
