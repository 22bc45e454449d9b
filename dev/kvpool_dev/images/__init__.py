"""Build and run the Dockerfile's images without a Docker daemon or a registry.

  kvpool_dev.images.dockerfile  parse the Dockerfile: stages, build args, the documented tags
"""
