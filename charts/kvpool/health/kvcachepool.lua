-- Argo CD health check for kvpool.dev/KVCachePool.
-- Install: argocd-cm `resource.customizations.health.kvpool.dev_KVCachePool` (see docs/helm.md).
-- kstatus rules: a status the operator wrote for an older generation says nothing about the
-- current spec, so it is Progressing until observedGeneration catches up; then an invalid
-- config, Degraded=True or Stalled=True is Degraded; Ready=True is Healthy; the rest Progressing.

local function result(status, message)
  return {status = status, message = message}
end

local function describe(c, fallback)
  if c == nil then
    return fallback
  end
  if c.message ~= nil and c.message ~= "" then
    return c.message
  end
  if c.reason ~= nil and c.reason ~= "" then
    return c.reason
  end
  return fallback
end

local function evaluate(obj)
  local status = obj.status
  if status == nil then
    return result("Progressing", "Waiting for the kvpool operator to report status")
  end

  local generation = obj.metadata.generation
  local observed = status.observedGeneration
  if observed == nil or (generation ~= nil and observed < generation) then
    return result("Progressing", "Waiting for the kvpool operator to observe generation " .. tostring(generation))
  end

  local byType = {}
  for _, c in ipairs(status.conditions or {}) do
    if c.type ~= nil then
      byType[c.type] = c
    end
  end
  local function is(ctype, value)
    return byType[ctype] ~= nil and byType[ctype].status == value
  end

  if is("ConfigValid", "False") or status.phase == "Invalid" then
    return result("Degraded", describe(byType["ConfigValid"], "Invalid configuration"))
  end
  for _, ctype in ipairs({"Degraded", "Stalled"}) do
    if is(ctype, "True") then
      return result("Degraded", describe(byType[ctype], ctype))
    end
  end
  if is("Ready", "True") then
    return result("Healthy", describe(byType["Ready"], "Ready"))
  end
  return result("Progressing", describe(byType["Progressing"], describe(byType["Ready"], "Waiting for the pool to become ready")))
end

return evaluate(obj)
