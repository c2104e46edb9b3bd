// balancer web: refresh each [data-poll] element from its HTML fragment every data-every ms.
// The fragments are rendered (and escaped) by the server; no other script runs on the pages.
"use strict";
document.querySelectorAll("[data-poll]").forEach(function (el) {
  var every = parseInt(el.getAttribute("data-every"), 10) || 2000;
  var busy = false;
  setInterval(function () {
    if (busy || document.hidden) { return; }
    busy = true;
    fetch(el.getAttribute("data-poll"), {credentials: "same-origin", cache: "no-store"})
      .then(function (r) { return r.ok ? r.text() : Promise.reject(r.status); })
      .then(function (html) { el.innerHTML = html; el.classList.remove("stale"); })
      .catch(function () { el.classList.add("stale"); })
      .finally(function () { busy = false; });
  }, every);
});
