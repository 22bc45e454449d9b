"""Names the whole operator agrees on (render, reconcile, kube client, CRD): kept below render/
so that reconcile and the API client never import the renderers for a constant."""

MANAGER = "kvpool-operator"  # app.kubernetes.io/managed-by and the server-side apply field manager
POOL_LABEL = "kvpool.dev/pool"  # on every child: what the reconciler lists and prunes by
CHECKSUM_ANNOTATION = "kvpool.dev/config-checksum"
GENERATE_ANNOTATION = "kvpool.dev/generate-keys"
MAX_POOL_NAME = 57  # "<name>-minio" must stay a 63-character DNS label
