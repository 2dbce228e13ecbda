"""specgen: declarative attention specs rendered into cuTile kernel modules.

The pipeline is Spec -> Plan -> Emit -> Compile -> Check:

- :mod:`specgen.spec.model`     the strict Pydantic model a user writes in YAML;
- :mod:`specgen.plan.make`     frozen values derived from a spec, ready to print;
- :mod:`specgen.emit.render`   Jinja2 templates + black -> a standalone module;
- :mod:`specgen.compile.export`  AOT cubins per GPU target through cuda-tile;
- :mod:`specgen.check.reference` the fp64 reference the kernels are checked against.
"""

__version__ = "0.1.0"
