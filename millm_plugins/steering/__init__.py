"""SAE feature steering: SAEs from local files, inline steering, profiles, clusters with an
intensity dial, manual values, and the ``X-miLLM-Steering`` report.

Public to other plugins (stable names; the activations, probes and circuits plugins use
exactly these, and a third party's plugin may too):

- :mod:`.sae`: ``SAE`` (``encode``, ``restricted``, ``direction``, ``encode_refusal``),
  ``load_sae``, ``hook_point``;
- :mod:`.api`: ``STATE`` (the app stash key of the ``SteeringState``; its ``live``
  snapshot has the attachments, the loaded SAEs, the profiles and the epoch),
  ``state_of``, ``dials_of``, ``plain_plan``;
- :mod:`.live`: ``Live`` (the snapshot), :mod:`.registry`: ``SteeringState``;
- :mod:`.contrib`: the extension point through which another plugin's global steering
  (circuits) joins a request's steering decision and its report;
- :mod:`.apply`: ``Plan``, ``Entry``, ``Dials``, ``profile_entry``, ``report`` (the
  header's grammar: build members with it, never by hand);
- :mod:`.intensity`: the dial (``parse``, ``resolve``, ``resolve_clamped``, ``bounds``,
  ``clamped_bounds``, ``is_off``);
- :mod:`.inline`, :mod:`.profiles`: the request field's Struct and the errors
  (``SAENotAttached``, ``InvalidFeatureIndex``), profiles and cluster documents.

Everything else is internal.
"""
