"""Build and run the Dockerfile's images without a Docker daemon or a registry (`make images`,
`make test-images`).

  kvpool_dev.images.dockerfile  parse the Dockerfile: stages, build args, the documented tags
  kvpool_dev.images.build       the Debian base, the wheel directory, `buildah build` per target
  kvpool_dev.images.podman      run an image the way a rendered pod spec runs it (user,
                                read-only root, emptyDirs, env), sizes and layers
  kvpool_dev.images.contents    what an image may not contain (compilers, dev tooling, tests)

The smoke tests that run the built images are tests/images/ (see docs/helm.md, "Images").
"""
