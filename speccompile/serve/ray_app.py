"""Scale-out on Ray Serve: the same FastAPI application (app.py) as a deployment of N replicas, each
with a Runtime of its own over the bundle; Ray's HTTP proxy spreads the requests among them.

    speccompile serve BUNDLE --ray --replicas 2        (the ray extra: pip install 'speccompile[ray]')

or, from Python, `serve.run(speccompile.serve.ray_app.application("bundle/", replicas=2))`.
"""


def application(bundle: str, replicas: int = 1, model_name: str = "speccompile", max_batch: int | None = None,
                cpus_per_replica: float = 1.0, **server_options):
    """A Ray Serve application of `replicas` copies of the server, each building its runtime and app
    when Ray starts it (the builder runs on the replica, so nothing heavy is pickled). options: the
    server_options: the server's (app.create_app: api_key, gamma, proposer, p_min, chat_template)."""
    from ray import serve

    def build():
        from speccompile.runtime.runtime import load
        from speccompile.serve.app import create_app

        runtime = load(bundle, shared_threads=True, max_batch=max_batch)  # a replica's process is ours
        return create_app(runtime, model_name, **server_options)

    ingress = serve.ingress(build)()
    options = {"num_replicas": replicas, "ray_actor_options": {"num_cpus": cpus_per_replica}}
    return serve.deployment(name="speccompile", **options)(ingress).bind()
