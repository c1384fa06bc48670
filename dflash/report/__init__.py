"""A run's report: plots of the stages' artifacts under ``results/`` (``plots``), one self-contained page that embeds
them (``page``, assembled by ``build``), and that page rendered in headless Chromium (``browser``)."""
