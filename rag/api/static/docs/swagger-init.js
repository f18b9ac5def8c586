// Starts Swagger UI on /docs. A file, not an inline script, so the page's CSP can forbid inline
// code; the schema URL comes from the page (data-openapi-url), nothing from the query string.
"use strict";

window.addEventListener("DOMContentLoaded", () => {
  const root = document.getElementById("swagger-ui");
  window.ui = SwaggerUIBundle({
    url: root.dataset.openapiUrl,
    domNode: root,
    layout: "BaseLayout",
    deepLinking: true,
    // The key typed into "Authorize" stays in this tab's memory, never in localStorage.
    persistAuthorization: false,
    // No call to swagger.io's online validator (offline clusters; and the schema stays here).
    validatorUrl: null,
    presets: [SwaggerUIBundle.presets.apis],
  });
});
