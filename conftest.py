"""pytest: the doctests of the trainer integrations need their trainers (the extras
``lightning`` and ``transformers``); without them those modules are not collected."""

import importlib.util

collect_ignore = [f"usbyte_opt/integrations/{name}.py"
                  for name, package in (("lightning", "lightning"), ("transformers", "transformers"),
                                        ("accelerate", "accelerate"))
                  if importlib.util.find_spec(package) is None]
